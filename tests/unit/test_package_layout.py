"""The package's shape: no import cycle among its modules (function-level imports included), the test support
package (eagle3_data.testing) used by tests and benchmarks only, and a library that works without the repository
(the config schema ships as package data: tests/workflow/test_plain_install.py)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"


def import_graph(src: Path, package: str) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, anywhere in its body (a module importing a name from a package
    depends on that package's ``__init__`` and, where the name is a submodule, on it)."""
    mods = {}
    for p in (src / package).rglob("*.py"):
        rel = p.relative_to(src).with_suffix("")
        mods[".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)] = p
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, p in mods.items():
        is_pkg = p.name == "__init__.py"
        for n in ast.walk(ast.parse(p.read_text())):
            if isinstance(n, ast.Import):
                targets = [a.name for a in n.names]
            elif isinstance(n, ast.ImportFrom):
                if n.level:
                    base = m.split(".") if is_pkg else m.split(".")[:-1]
                    base = base[: len(base) - (n.level - 1)]
                    b = ".".join(base + ([n.module] if n.module else []))
                else:
                    b = n.module or ""
                targets = [b] + [f"{b}.{a.name}" for a in n.names]
            else:
                continue
            for t in targets:
                while t and t not in mods and "." in t:
                    t = t.rsplit(".", 1)[0]
                if t in mods and t != m and not m.startswith(t + "."):  # a module and its own package's face
                    edges[m].add(t)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected sets of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_cycle_through_a_function_level_import(tmp_path):
    pkg = tmp_path / "p"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from .sub.c import g\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("def g():\n    from ..a import x\n")
    (pkg / "d.py").write_text("from .a import b\n")
    assert cycles(import_graph(tmp_path, "p")) == [["p.a", "p.b", "p.sub.c"]]


def test_the_package_has_no_import_cycle():
    found = cycles(import_graph(SRC, "eagle3_data"))
    assert found == [], "\n".join(", ".join(c) for c in found)


def test_the_test_support_package_is_used_by_no_module_of_the_library_nor_the_workflow():
    """``eagle3_data.testing`` (the fault server, tokenizer fixtures, ... of tests/ and benchmarks/) imports the
    library; nothing of the library, the scripts or the rules imports it (it is test support, shipped like
    numpy.testing)."""
    edges = import_graph(SRC, "eagle3_data")
    support = "eagle3_data.testing"
    users = sorted(
        f"{m} -> {t}"
        for m, ts in edges.items()
        if not (m == support or m.startswith(support + "."))
        for t in ts
        if t == support or t.startswith(support + ".")
    )
    assert users == []
    workflow = [ROOT / "Snakefile", *(ROOT / "rules").glob("*.smk"), *(ROOT / "scripts").glob("*.py")]
    assert [p.name for p in workflow if support in p.read_text()] == []


def test_no_module_is_named_like_a_standard_library_module_and_one_is_named_settings():
    names = [p.stem if p.name != "__init__.py" else p.parent.name for p in (SRC / "eagle3_data").rglob("*.py")]
    assert sorted(set(names) & set(sys.stdlib_module_names) - {"__main__"}) == []
    assert names.count("settings") == 1


def private_imports(src: Path, package: str) -> list[str]:
    """``module: name`` for each underscore name (not a dunder) that a module of the package imports from another of
    its modules, or reads as an attribute of a package module it imported (``mod._name``)."""
    found = []
    for p in sorted((src / package).rglob("*.py")):
        rel = p.relative_to(src).with_suffix("")
        m = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        base_parts = m.split(".") if p.name == "__init__.py" else m.split(".")[:-1]
        tree = ast.parse(p.read_text())
        aliases = set()
        for n in ast.walk(tree):
            if isinstance(n, ast.ImportFrom):
                if n.level:
                    b = ".".join(base_parts[: len(base_parts) - (n.level - 1)] + ([n.module] if n.module else []))
                else:
                    b = n.module or ""
                if b != package and not b.startswith(package + "."):
                    continue
                for a in n.names:
                    if a.name.startswith("_") and not a.name.startswith("__"):
                        found.append(f"{m}: {b}.{a.name}")
                    aliases.add(a.asname or a.name)
            elif isinstance(n, ast.Import):
                aliases.update(a.asname for a in n.names if a.asname and a.name.startswith(package))
        for n in ast.walk(tree):
            if (
                isinstance(n, ast.Attribute)
                and isinstance(n.value, ast.Name)
                and n.value.id in aliases
                and n.attr.startswith("_")
                and not n.attr.startswith("__")
            ):
                found.append(f"{m}: {n.value.id}.{n.attr}")
    return found


def test_the_private_name_finder_finds_one(tmp_path):
    pkg = tmp_path / "p"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def _f(): pass\ndef g(): pass\n__all__ = []\n")
    (pkg / "b.py").write_text("from .a import _f, g, __all__\nfrom os import _exit\n")
    (pkg / "c.py").write_text("from . import a\n\ndef h():\n    return a._f()\n")
    assert private_imports(tmp_path, "p") == ["p.b: p.a._f", "p.c: a._f"]


def test_no_module_uses_another_modules_private_name():
    found = private_imports(SRC, "eagle3_data")
    assert found == [], "\n".join(found)


def stage_entry_points() -> dict[str, tuple[int, int]]:
    """``module.function`` -> (source lines with the docstring, parameters) of each library function a rule's script
    (scripts/*.py) calls."""
    import importlib
    import inspect

    found = {}
    for script in sorted((ROOT / "scripts").glob("*.py")):
        tree = ast.parse(script.read_text())
        imported = {
            a.asname or a.name: (n.module, a.name)
            for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("eagle3_data")
            for a in n.names
        }
        for n in ast.walk(tree):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in imported:
                mod, name = imported[n.func.id]
                obj = getattr(importlib.import_module(mod), name)
                if inspect.isfunction(obj):
                    found[f"{obj.__module__}.{obj.__qualname__}"] = (
                        len(inspect.getsource(obj).splitlines()),
                        len(inspect.signature(obj).parameters),
                    )
    return found


def test_no_stage_entry_point_is_over_100_lines_or_10_parameters():
    """Issue 36's bound: a stage's entry point reads as a short list of named steps."""
    found = stage_entry_points()
    assert {
        "eagle3_data.merge.stage.merge",
        "eagle3_data.generate.job.generate",
        "eagle3_data.export.stage.export",
    } <= set(found)
    assert {k: v for k, v in found.items() if v[0] > 100 or v[1] > 10} == {}
