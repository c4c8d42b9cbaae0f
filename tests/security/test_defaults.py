"""Secure by default: `recover coordinator` serves loopback unless told, and never a routable
address without a token unless `--no-token` says so (one line, exit 2, nothing started)."""

from __future__ import annotations

import pytest

from recover.control import CoordinatorConfig
from recover.control.coordinator import main
from recover.errors import ExitCode

pytestmark = pytest.mark.timeout(30)


def test_the_default_bind_is_loopback() -> None:
    assert CoordinatorConfig(replicas=1).host == "127.0.0.1"


def test_a_routable_address_without_a_token_is_refused(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("RECOVER_RUN_TOKEN", raising=False)
    assert main(["--replicas", "1", "--host", "0.0.0.0", "--port", "0"]) == ExitCode.USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no token is set" in err[0] and "--no-token" in err[0], err
