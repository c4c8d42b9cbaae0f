"""Integrations of recover with other training frameworks, each an optional extra.

Invariant: the library layers never import this package; each module here imports its framework
only when it is itself imported, so `import recover` works without any of them.
"""
