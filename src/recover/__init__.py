"""recover: resilient LLM pre-training (ReCoVer).

Three protocol layers with one-way dependencies (workload <- recovery -> collectives):
`recover.collectives` (fault-tolerant collectives), `recover.recovery` (in-step recovery) and
`recover.workload` (versatile workload). `recover.train` is the reference trainer built on their
public API.
"""

__version__ = "0.1.0"
