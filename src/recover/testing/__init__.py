"""The test harness: what the test suite and the benchmarks both need to run and judge recover.

Invariant: this package sits on top of the reference app (`recover.app`) and the library, and
nothing but tests and benchmarks imports it (the library and the app never do). It offers one way
of each thing: ranks run in-process as threads (`inproc`), processes started and ended by PID
with their log files (`processes`, on `recover.procs`), one integer-gradient oracle (`oracle`),
`recover train` runs and what they wrote (`runs`), and the protocol ranks of the scale benchmark
(`scale`).
"""
