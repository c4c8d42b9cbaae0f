"""The house rules, checked on the source tree itself (no imports of it: the AST only).

- The library (`recover.collectives`, `recovery`, `workload`, `parallel`, `data` and the top-level
  modules `settings`, `errors`, `procs`) imports nothing of the reference app (`recover.app`),
  the test harness (`recover.testing`) or the simulator (`recover.sim`), not even lazily; the
  simulator imports nothing of the others; there is no cycle between recover's packages; only
  `recover.integrations` imports torchtitan.
- No module imports a private name (`_x`) from another module.
- No class in the library inherits from more than one base (no mixins sharing state).
- No function in `src/` is longer than 80 lines or takes more than 10 parameters.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"
LIBRARY = ("recover.collectives", "recover.recovery", "recover.workload", "recover.parallel",
           "recover.data", "recover.settings", "recover.errors", "recover.procs", "recover")
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
            base = mod.split(".") if is_pkg else mod.split(".")[:-1]
            if node.level:
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.append((target, [a.name for a in node.names], node.lineno))
    return out


def _in(mod: str, pkg: str) -> bool:
    return mod == pkg or mod.startswith(pkg + ".")


def _is_library(mod: str) -> bool:
    return mod == "recover" or any(_in(mod, p) for p in LIBRARY if p != "recover")


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
                                        ("recover.app", "recover.testing", "recover.sim")):
                bad.append(f"{mod}:{line} imports {target}")
            if _in(target, "torchtitan") and not _in(mod, "recover.integrations"):
                bad.append(f"{mod}:{line} imports {target} (torchtitan: integrations only)")
            if _in(mod, "recover.sim") and _in(target, "recover") and not _in(
                    target, "recover.sim") and target != "recover.errors":
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


def test_no_library_class_inherits_a_mixin() -> None:
    """A mixin here: a base that uses state it does not define (its host's), or a class with
    more than one base."""
    classes = {}
    for mod, tree, _ in _trees():
        if _is_library(mod):
            classes.update({n.name: n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)})
    bad = []
    for name, cls in classes.items():
        bases = [ast.unparse(b) for b in cls.bases
                 if ast.unparse(b) not in ("Protocol", "Generic", "object")]
        if len(bases) > 1:
            bad.append(f"{name}({', '.join(bases)}): more than one base")
        for base in bases:
            if base in classes:
                borrowed = _self_reads(classes[base]) - _own_names(classes[base])
                if borrowed:
                    bad.append(f"{name}({base}): {base} uses its host's "
                               f"{', '.join(sorted(borrowed))}")
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
