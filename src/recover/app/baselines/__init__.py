"""Baselines the benchmarks compare `recover` against, and `recover bench` (docs/DESIGN.md,
"Layers and packages").

- shrink-batch (torchft's reaction): the library's `recover.recovery.shrink` strategy, selected
  by `RunConfig.ft.policy`; `runs` runs each system with the real trainer.
- `ckpt_restart`: checkpoint every K steps (Young-Daly), tear down and relaunch on every fault.
- `bench`: `recover bench`, every system under one fault schedule, and the simulator's validation.

Invariant: a baseline reuses the real trainer and changes only the reaction to a lost replica.
"""
