"""Replica layouts: how a replica's internal parallelism exposes its local gradient to layer 2."""

from recover.parallel.plain import flat_grad_buffer

__all__ = ["flat_grad_buffer"]
