"""The reference app: `recover train`, its launcher, model, data, checkpoints, metrics, fault
injection, the baselines and `recover bench`.

Invariant: the app sits on top of the library (`recover.collectives`, `recover.recovery`,
`recover.workload`, `recover.replica`, `recover.layouts`) and uses only its public API; nothing
in the library imports the app.
"""
