#!/usr/bin/env python3
"""Docs that run: every shell block of README.md and docs/*.md is run as its page says.

Invariant: a shell block of a page is run by this script, in a fresh virtualenv that the page's
own install commands built, in a fresh copy of the checkout, unless the HTML comment just above
the block (blank lines between are allowed) says otherwise:

    <!-- not run: WHY -->             not run; the page tells the reader why (a GPU, a cluster,
                                      files of the reader's own, a long benchmark, the network)
    <!-- run by .ci/run: NAME -->     .ci/run runs it itself, as `rundocs.py --step NAME`, in the
                                      checkout (the README's test command: it is CI's main step)
    <!-- expect: CLAUSE, ... -->      run in a subshell of its own (its first failing command
                                      ends it) and judged by its exit code and output instead of
                                      ending the page: `exit N` (default 0), `line "S"` (a line
                                      of its output starts with S), `not "S"` (no line holds S)

tests/test_docs_commands.py parses every page with this module and fails on what this script
could not run: a marker with no reason or on no shell block, a step .ci/run does not run, a page
that runs commands but installs nothing. So a new command in the docs is run by CI, or says why
it is not, and a command that no longer works as the page says fails CI.

What counts as a shell block: a fenced block tagged sh, bash, shell, console or zsh; and any
untagged or `text` fenced block or indented code block in which a line reads as a command (its
first word, past `VAR=value` words, is a command name of COMMANDS, or a path such as
`.venv/bin/pip` or `./x`). Other tags (python, diff, toml, json, yaml) are code to read, not to run.

How a page runs:
- Its install commands are the leading `python3 -m venv ...` and `... pip install ...` parts (split
  at ` && `) of the top-level lines of its run blocks (an `expect` block runs whole, where it
  stands), in page order; the first must be
  `python3 -m venv .venv`. Pages with the same install commands share one virtualenv, built once
  by running those commands, as written, in a copy of the checkout, and removed after the last
  page that uses it (each holds a torch: gigabytes).
- The page's blocks, less those install parts, run in order in one bash session (an `export`
  carries to the next block, as in a reader's terminal) in its own copy of the checkout, whose
  `.venv` links that virtualenv; with `set -eo pipefail` and `.venv/bin` first on PATH (as after
  `source .venv/bin/activate`, which the pages assume past their install line). A bare `wait`
  fails when a background job of the session failed (bash's own returns 0 whatever its jobs did,
  so a replica's failed `torchrun` in a `... & done; wait` recipe would pass unseen).
- Every process the page started is ended by PID when the page ends or passes its time limit.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHELL_TAGS = {"sh", "bash", "shell", "console", "zsh"}
LOOSE_TAGS = {"", "text"}  # judged by their lines: a command in them is a shell block
# First words that make a line a command (past `VAR=value` words and a leading `(`).
COMMANDS = {
    "recover", "python", "python3", "pip", "pip3", "torchrun", "torchx", "export", "for",
    "while", "if", "source", "sbatch", "srun", "scontrol", "kubectl", "docker", "tensorboard",
    "wandb", "hf", "huggingface-cli", "cd", "git", "diff", "bash", "sh", "openssl", "curl",
    "wget", "uv", "conda", "make", "sudo", "apt", "apt-get", "mkdir", "cp", "mv", "rm", "ls",
    "cat", "echo", "tar", "nvidia-smi", "ssh", "scp",
}
INSTALL = re.compile(r"^(python3? -m venv\s|(\S*/)?pip3? install\s)")
FRESH_VENV = "python3 -m venv .venv"
MARKER = re.compile(r"^\s*<!--\s*(not run|run by \.ci/run|expect)\s*:\s*(.*?)\s*-->\s*$")
FENCE = re.compile(r"^( {0,3})(`{3,}|~{3,})\s*([\w+-]*)")
PAGE_LIMIT_S = 1800.0  # one page, its longest recipe included, on a loaded 2-core machine
VENV_LIMIT_S = 1800.0  # one virtualenv: torch and every extra a page names


class PageError(Exception):
    """A page this script cannot run as written (one line naming the page and line)."""


@dataclass(frozen=True)
class Marker:
    kind: str  # "not run", "run by .ci/run" or "expect"
    arg: str
    line: int


@dataclass(frozen=True)
class Block:
    page: str  # relative to the checkout's root
    line: int  # 1-based line of the block's first line of code
    text: str  # the code, dedented
    shell: bool
    marker: Marker | None

    @property
    def status(self) -> str:
        """`run`, `expect`, `not run`, `step` (.ci/run's own) or `code` (not a shell block)."""
        if not self.shell:
            return "code"
        if self.marker is None:
            return "run"
        return {"run by .ci/run": "step"}.get(self.marker.kind, self.marker.kind)

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


@dataclass(frozen=True)
class Expect:
    exit: int
    lines: tuple[str, ...]  # each starts some line of the output (leading blanks aside)
    absent: tuple[str, ...]  # no line of the output holds any


def pages(root: Path = ROOT) -> list[Path]:
    """The pages whose commands run: README.md and docs/*.md."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def _indent(line: str) -> int:
    expanded = line.expandtabs(4)
    return len(expanded) - len(expanded.lstrip(" "))


def logical_lines(text: str) -> list[str]:
    """The block's lines with `\\` continuations joined (a continued line keeps its indent)."""
    out: list[str] = []
    carry = ""
    for raw in text.splitlines():
        if carry:
            raw = carry + " " + raw.strip()
        if raw.rstrip().endswith("\\"):
            carry = raw.rstrip()[:-1].rstrip()
            continue
        carry = ""
        out.append(raw)
    if carry:
        out.append(carry)
    return out


def is_command(line: str) -> bool:
    """Whether a line of a block reads as a shell command (COMMANDS; a path to run)."""
    words = line.strip().lstrip("(").split()
    while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
        words = words[1:]
    if not words or words[0].startswith("#"):
        return False
    first = words[0]
    return first in COMMANDS or first.startswith(("./", ".venv/", "~/")) or "/bin/" in first


def parse(page: Path, root: Path = ROOT) -> list[Block]:
    """Every code block of a page, with the marker above it; PageError on a marker that belongs
    to no shell block or an unclosed fence."""
    name = page.relative_to(root).as_posix()
    lines = page.read_text().splitlines()
    blocks: list[Block] = []
    marker: Marker | None = None
    blank = True  # an indented block starts only after a blank line (it cannot end a paragraph)
    i = 0

    def add(line: int, text: str, shell: bool) -> None:
        nonlocal marker
        if marker is not None and not shell:
            raise PageError(f"{name}:{marker.line}: marker above a block that is not a shell "
                            f"block (line {line})")
        blocks.append(Block(name, line, text, shell, marker))
        marker = None

    while i < len(lines):
        line = lines[i]
        fence = FENCE.match(line)
        if fence:
            indent, ticks, tag = len(fence.group(1)), fence.group(2), fence.group(3).lower()
            end = i + 1
            while end < len(lines) and not (lines[end].strip().startswith(ticks)
                                            and lines[end].strip().strip(ticks[0]) == ""):
                end += 1
            if end == len(lines):
                raise PageError(f"{name}:{i + 1}: a fence that is never closed")
            body = [raw[indent:] if raw[:indent].strip() == "" else raw.lstrip()
                    for raw in lines[i + 1:end]]
            text = "\n".join(body)
            shell = tag in SHELL_TAGS or (tag in LOOSE_TAGS
                                          and any(map(is_command, logical_lines(text))))
            add(i + 2, text, shell)
            i, blank = end + 1, False
            continue
        found = MARKER.match(line)
        if found:
            if marker is not None:
                raise PageError(f"{name}:{marker.line}: a marker with no block before the next")
            if not found.group(2):
                raise PageError(f"{name}:{i + 1}: `{found.group(1)}:` says nothing after it")
            marker = Marker(found.group(1), found.group(2), i + 1)
            i, blank = i + 1, True  # a comment ends its HTML block: code may follow at once
            continue
        if blank and line.strip() and _indent(line) >= 4:
            end = i
            while end < len(lines) and (not lines[end].strip() or _indent(lines[end]) >= 4):
                end += 1
            while not lines[end - 1].strip():
                end -= 1
            code = lines[i:end]
            cut = min(_indent(raw) for raw in code if raw.strip())
            text = "\n".join(raw.expandtabs(4)[cut:] for raw in code)
            add(i + 1, text, any(map(is_command, logical_lines(text))))
            i, blank = end, False
            continue
        if line.strip():
            if marker is not None:
                raise PageError(f"{name}:{marker.line}: a marker with no code block under it")
            blank = False
        else:
            blank = True
        i += 1
    if marker is not None:
        raise PageError(f"{name}:{marker.line}: a marker with no code block under it")
    return blocks


def parse_expect(block: Block) -> Expect:
    """An `expect:` marker's clauses; PageError on one it does not know."""
    assert block.marker is not None
    code, lines, absent = 0, [], []
    for clause in re.findall(r'\s*((?:[^,"]|"[^"]*")+)', block.marker.arg):
        clause = clause.strip()
        if m := re.fullmatch(r"exit (\d+)", clause):
            code = int(m.group(1))
        elif m := re.fullmatch(r'line "([^"]+)"', clause):
            lines.append(m.group(1))
        elif m := re.fullmatch(r'not "([^"]+)"', clause):
            absent.append(m.group(1))
        else:
            raise PageError(f"{block.page}:{block.marker.line}: expect: unknown clause {clause!r}"
                            ' (exit N, line "S", not "S")')
    return Expect(code, tuple(lines), tuple(absent))


def split_install(blocks: list[Block]) -> tuple[list[str], dict[int, str]]:
    """A page's install commands (in order) and each run block's text without them (by line).

    Only a top-level line's leading ` && `-parts count: an install inside a loop or after another
    command is the page's business, run where it stands."""
    installs: list[str] = []
    bodies: dict[int, str] = {}
    for block in blocks:
        if block.status not in ("run", "expect"):
            continue
        if block.status == "expect":
            bodies[block.line] = block.text
            continue
        kept: list[str] = []
        for line in logical_lines(block.text):
            parts = line.split(" && ") if line[:1] not in (" ", "\t") else [line]
            while parts and INSTALL.match(parts[0]):
                installs.append(parts.pop(0).strip())
            if parts:
                kept.append(" && ".join(parts))
        bodies[block.line] = "\n".join(kept)
    return installs, bodies


def problems(page: Path, root: Path = ROOT, ci_script: Path | None = None) -> list[str]:
    """What would stop this script from running the page as written, one line each."""
    ci_text = (ci_script or root / ".ci" / "run").read_text()
    try:
        blocks = parse(page, root)
        found: list[str] = []
        for block in blocks:
            if block.status == "expect":
                parse_expect(block)
            if block.status == "step":
                assert block.marker is not None
                name = block.marker.arg
                if not re.fullmatch(r"[\w-]+", name):
                    found.append(f"{block.where}: `run by .ci/run:` takes one step name: {name!r}")
                elif not re.search(rf"rundocs\.py --step {re.escape(name)}\b", ci_text):
                    found.append(f"{block.where}: .ci/run runs no `rundocs.py --step {name}`")
        installs, bodies = split_install(blocks)
        if any(text.strip() for text in bodies.values()) and not installs:
            found.append(f"{page.relative_to(root)}: runs commands but installs nothing: give it "
                         f"its install block ({FRESH_VENV} && ...) or mark them not run")
        elif installs and installs[0] != FRESH_VENV:
            found.append(f"{page.relative_to(root)}: its first install command is "
                         f"{installs[0]!r}, not {FRESH_VENV!r} (a fresh venv)")
        return found
    except PageError as e:
        return [str(e)]


# -- running -------------------------------------------------------------------------------------
PRELUDE = """\
set -eo pipefail
export PATH="$PWD/.venv/bin:$PATH" VIRTUAL_ENV="$PWD/.venv"
# A bare `wait` fails with the first failed background job's code: the DEBUG trap records each
# job's PID ($! after the command that started it), since `jobs -p` forgets finished ones.
_rundocs_seen=" " _rundocs_bg=""
_rundocs_track() {
  [ -n "$1" ] || return 0
  case "$_rundocs_seen" in *" $1 "*) return 0 ;; esac
  _rundocs_seen="$_rundocs_seen$1 " _rundocs_bg="$_rundocs_bg $1"
}
trap '_rundocs_track "$!"' DEBUG
wait() {
  if [ $# -gt 0 ]; then builtin wait "$@"; return; fi
  local rc=0 s pid pids="$_rundocs_bg"
  _rundocs_bg=""
  for pid in $pids; do builtin wait "$pid" && s=0 || s=$?; [ "$rc" -ne 0 ] || rc=$s; done
  return "$rc"
}
"""


def page_script(blocks: list[Block], bodies: dict[int, str], state: Path) -> str:
    """The bash script that runs a page's blocks in order (see the module's docstring)."""
    out = [PRELUDE]
    for block in blocks:
        body = bodies.get(block.line)
        if body is None:
            continue
        out.append(f'echo "rundocs: [+${{SECONDS}}s] {block.where} ({block.status})"')
        out.append(f"echo {block.line} > {shlex.quote(str(state / 'current'))}")
        if block.status == "expect":
            log, rc = (shlex.quote(str(state / f"{kind}.{block.line}")) for kind in ("out", "rc"))
            # Its own subshell: the first failing command ends it, with that command's code.
            out += ["set +e", "(", "set -e", body, f") > {log} 2>&1", f"echo $? > {rc}",
                    "set -e", f"cat {log}"]
        elif body.strip():
            out.append(body)
    out.append(f"echo done > {shlex.quote(str(state / 'current'))}")
    return "\n".join(out) + "\n"


def judge_expect(block: Block, state: Path) -> str | None:
    """Why an `expect` block failed its marker; None when it passed."""
    expect = parse_expect(block)
    rc_file, out_file = state / f"rc.{block.line}", state / f"out.{block.line}"
    if not rc_file.exists():
        return f"{block.where}: not reached"
    rc, out = int(rc_file.read_text()), out_file.read_text().splitlines()
    if rc != expect.exit:
        return f"{block.where}: exit {rc}, expected {expect.exit}"
    for want in expect.lines:
        if not any(line.lstrip().startswith(want) for line in out):
            return f"{block.where}: no line of its output starts with {want!r}"
    for bad in expect.absent:
        if any(bad in line for line in out):
            return f"{block.where}: its output holds {bad!r}"
    return None


def copy_checkout(dst: Path) -> None:
    """The checkout's files (tracked, and untracked but not ignored) into dst: no venv, no runs."""
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others",
                             "--exclude-standard"], capture_output=True, check=True,
                            timeout=60).stdout.decode()
    for rel in filter(None, listed.split("\0")):
        src = ROOT / rel
        if src.is_file() and not src.is_symlink():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)


def _session_members(sid: int) -> list[int]:
    """The PIDs of session sid (Linux /proc): what a page's shell started, its background jobs
    included after the shell itself has exited and they were reparented."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[3]) == sid:  # after ")": state, ppid, pgrp, session
            found.append(int(stat.parent.name))
    return found


def run_script(script: str, cwd: Path, log: Path, limit_s: float) -> int:
    """Run a bash script in cwd, output to log; end every process it left (by PID); its code
    (124 past the limit)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    path = cwd / ".rundocs.sh"
    path.write_text(script)
    with log.open("ab") as out:
        proc = subprocess.Popen(["bash", str(path)], cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
        try:
            code = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            code = 124
        # The script ran in a session of its own (start_new_session): its id is the shell's PID.
        # The shell itself is in it while it runs; once reaped, its PID is no longer ours.
        for pid in _session_members(proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()
    return code


def _tail(log: Path, lines: int = 60) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def run_pages(chosen: list[Path], work: Path, keep: bool) -> int:
    """Run the pages; one line per page, the log's tail for a failure; 1 if any failed."""
    plans: dict[tuple[str, ...], list[tuple[Path, list[Block], dict[int, str]]]] = {}
    failed: list[str] = []
    for page in chosen:
        trouble = problems(page)
        if trouble:
            failed += trouble
            continue
        blocks = parse(page)
        installs, bodies = split_install(blocks)
        if any(text.strip() for text in bodies.values()):
            plans.setdefault(tuple(installs), []).append((page, blocks, bodies))
    for n, (installs, group) in enumerate(plans.items()):
        venv = work / f"venv{n}"
        venv.mkdir(parents=True)
        copy_checkout(venv)
        log = work / f"venv{n}.log"
        started = time.monotonic()
        code = run_script("set -eo pipefail\n" + "\n".join(installs) + "\n", venv, log,
                          VENV_LIMIT_S)
        names = ", ".join(str(p.relative_to(ROOT)) for p, _, _ in group)
        print(f"rundocs: venv{n} for {names}: exit {code} ({time.monotonic() - started:.0f} s)",
              flush=True)
        if code != 0:
            print(_tail(log), flush=True)
            failed.append(f"the install of {names}: exit {code}")
            continue
        for page, blocks, bodies in group:
            failed += run_page(page, blocks, bodies, venv, work)
        if not keep:
            shutil.rmtree(venv, ignore_errors=True)
    for line in failed:
        print(f"rundocs: FAILED {line}", flush=True)
    return 1 if failed else 0


def run_page(page: Path, blocks: list[Block], bodies: dict[int, str], venv: Path,
             work: Path) -> list[str]:
    """Run one page's blocks in a fresh copy of the checkout; what failed, one line each."""
    name = page.relative_to(ROOT).as_posix()
    slug = re.sub(r"\W+", "-", name)
    cwd, state = work / slug, work / f"{slug}.state"
    cwd.mkdir()
    state.mkdir()
    copy_checkout(cwd)
    (cwd / ".venv").symlink_to(venv / ".venv")
    log = work / f"{slug}.log"
    started = time.monotonic()
    code = run_script(page_script(blocks, bodies, state), cwd, log, PAGE_LIMIT_S)
    failed = [why for block in blocks if block.status == "expect"
              if (why := judge_expect(block, state)) is not None]
    current = (state / "current").read_text().strip() if (state / "current").exists() else "?"
    if code != 0:
        failed.insert(0, f"{name}:{current}: exit {code}" + (" (time limit)" if code == 124
                                                           else ""))
    ran = sum(1 for b in blocks if b.status in ("run", "expect"))
    skipped = sum(1 for b in blocks if b.status in ("not run", "step"))
    print(f"rundocs: {name}: {'FAILED' if failed else 'ok'}, {ran} block(s) run, {skipped} not "
          f"here ({time.monotonic() - started:.0f} s; log {log})", flush=True)
    if failed:
        print(_tail(log), flush=True)
    return failed


def run_step(name: str) -> int:
    """Run the block marked `run by .ci/run: NAME` in the checkout itself; its exit code."""
    found = [b for page in pages() for b in parse(page)
             if b.status == "step" and b.marker is not None and b.marker.arg == name]
    if len(found) != 1:
        print(f"rundocs: {len(found)} blocks are .ci/run's step {name!r}, not one",
              file=sys.stderr)
        return 2
    print(f"rundocs: step {name}: {found[0].where}", flush=True)
    return subprocess.run(["bash", "-eo", "pipefail", "-c", found[0].text], cwd=ROOT).returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=".ci/rundocs.py", description=__doc__.split("\n")[0])
    parser.add_argument("pages", nargs="*", help="pages to run (default: README.md, docs/*.md)")
    parser.add_argument("--list", action="store_true", help="print each block's status; run none")
    parser.add_argument("--step", help="run .ci/run's step NAME (a `run by .ci/run:` block)")
    parser.add_argument("--work", type=Path, help="where the copies, venvs and logs go")
    parser.add_argument("--keep", action="store_true", help="keep the venvs and copies")
    args = parser.parse_args(argv)
    if args.step:
        return run_step(args.step)
    chosen = [(Path.cwd() / p).resolve() for p in args.pages] or pages()
    if args.list:
        trouble = []
        for page in chosen:
            trouble += problems(page)
            for block in parse(page):
                if block.shell:
                    note = f": {block.marker.arg}" if block.marker else ""
                    print(f"{block.where}\t{block.status}{note}")
        for line in trouble:
            print(f"rundocs: {line}", file=sys.stderr)
        return 1 if trouble else 0
    work = args.work or Path(tempfile.mkdtemp(prefix="rundocs-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"rundocs: work dir {work}", flush=True)
    code = run_pages(chosen, work, args.keep)
    if code == 0 and not args.keep and args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
