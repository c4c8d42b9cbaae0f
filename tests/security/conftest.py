"""The security scenarios are rows of docs/faults.md too: they fill the fault matrix's `record`
(tests/faults/conftest.py), so `RECOVER_FAULTS_DOC=1 pytest tests/faults tests/security` writes
their rows with the others'. Its session hook (the writer) is not imported here: a run of this
folder alone never rewrites the document with only these rows."""

from faults.conftest import pytest_runtest_makereport, record

__all__ = ["pytest_runtest_makereport", "record"]
