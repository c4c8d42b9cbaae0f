"""The test harness: what the test suite and the benchmarks both need to run and judge recover.

Invariant: this package sits on top of the reference app (`recover.app`) and the library, and
nothing but tests and benchmarks imports it (the library and the app never do). It offers one way
of each thing: ranks run in-process as threads (`inproc`), processes started and ended by PID
with their log files (`processes`, on `recover.procs`), one integer-gradient oracle (`oracle`),
`recover train` runs and what they wrote (`runs`), and the protocol ranks of the scale benchmark
(`scale`). It is not installed: it lives beside the benchmarks (bench/harness), and importing it
puts its folder on every child process's PYTHONPATH, so a process it starts (forked or a fresh
`python -m`) can import it too.
"""

import os
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent.parent)
if _HERE not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (_HERE, os.environ.get("PYTHONPATH", "")) if p)
