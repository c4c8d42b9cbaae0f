"""Baselines the benchmarks compare `recover` against, and `recover bench` (docs/DESIGN.md,
"Layers and packages").

- `shrink`: the shrink-batch (torchft) step engine, selected by `RunConfig.ft.policy`.
- `ckpt_restart`: checkpoint every K steps (Young-Daly), tear down and relaunch on every fault.
- `bench`: `recover bench`, every system under one fault schedule, and the simulator's validation.

Invariant: a baseline reuses the real trainer and changes only the reaction to a lost replica.
"""
