"""The pinned SGLang's source, read without importing it: the wheel from PyPI (``pip download``), parsed with ast.

Used by ``tests/workflow/test_sglang_contract.py``. No GPU, no sglang install: the wheel is only unpacked (``.py`` files
and its METADATA) into a cache directory (``$EAGLE3_WHEEL_CACHE``, default ``~/.cache/eagle3-data/wheels``).
"""

from __future__ import annotations

import ast
import functools
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path


def wheel_cache() -> Path:
    return Path(os.environ.get("EAGLE3_WHEEL_CACHE") or Path.home() / ".cache" / "eagle3-data" / "wheels")


def pinned_source(version: str) -> Path:
    """Directory holding ``sglang/`` (the ``.py`` files) and ``METADATA`` of the ``sglang==version`` wheel.

    Downloads the wheel once (CPython 3.11, manylinux x86_64: the platform the GPU env targets; the source read
    here is the same on every platform). Raises RuntimeError with pip's output when the download fails."""
    cache = wheel_cache()
    dest = cache / f"sglang-{version}-src"
    if (dest / "METADATA").is_file():
        return dest
    cache.mkdir(parents=True, exist_ok=True)
    wheels = sorted(cache.glob(f"sglang-{version}-*.whl"))
    if not wheels:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--platform",
            "manylinux_2_34_x86_64",
            "--python-version",
            "3.11",
            "--implementation",
            "cp",
            "-d",
            str(cache),
            f"sglang=={version}",
        ]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        wheels = sorted(cache.glob(f"sglang-{version}-*.whl"))
        if out.returncode != 0 or not wheels:
            raise RuntimeError(f"could not download sglang=={version} ({' '.join(cmd)}):\n{out.stdout}\n{out.stderr}")
    tmp = cache / f".sglang-{version}-src.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    with zipfile.ZipFile(wheels[0]) as zf:
        for name in zf.namelist():
            if name.startswith("sglang/") and name.endswith(".py"):
                zf.extract(name, tmp)
            elif name.endswith(".dist-info/METADATA"):
                (tmp / "METADATA").parent.mkdir(parents=True, exist_ok=True)
                (tmp / "METADATA").write_bytes(zf.read(name))
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest


@dataclass
class Found:
    """A definition found in the source: its node and where (``sglang/...py:line``)."""

    node: ast.AST
    module: str
    path: str
    line: int

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


class Source:
    """Look-ups in one unpacked SGLang source tree (``root`` holds ``sglang/``)."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def metadata(self) -> str:
        return (self.root / "METADATA").read_text()

    def file_of(self, module: str) -> Path:
        base = self.root / Path(*module.split("."))
        for cand in (base.with_suffix(".py"), base / "__init__.py"):
            if cand.is_file():
                return cand
        raise KeyError(f"module {module} not found in the wheel")

    def rel(self, path: Path) -> str:
        return str(path.relative_to(self.root))

    @functools.lru_cache(maxsize=None)  # noqa: B019 - one Source per test session
    def tree(self, module: str) -> ast.Module:
        return ast.parse(self.file_of(module).read_text())

    def text(self, module: str) -> str:
        return self.file_of(module).read_text()

    def _found(self, node, module) -> Found:
        return Found(node, module, self.rel(self.file_of(module)), node.lineno)

    def top_level(self, module: str, name: str, _depth: int = 0) -> Found | None:
        """The top-level def/class/assignment ``name`` of ``module``, following ``from x import name`` re-exports
        (and a module-level ``__getattr__`` table is not followed: such names are reported missing)."""
        tree = self.tree(module)
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
                return self._found(node, module)
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                return self._found(node, module)
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
                return self._found(node, module)
        if _depth < 4:
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    for alias in node.names:
                        if (alias.asname or alias.name) == name and node.module.startswith("sglang"):
                            return self.top_level(node.module, alias.name, _depth + 1)
            for node in tree.body:  # from sglang.x import *  (the name must not be private)
                if (
                    isinstance(node, ast.ImportFrom)
                    and node.module
                    and node.module.startswith("sglang")
                    and [a.name for a in node.names] == ["*"]
                    and not name.startswith("_")
                ):
                    found = self.top_level(node.module, name, _depth + 1)
                    if found is not None:
                        return found
        return None

    def resolve_name(self, module: str, name: str) -> tuple[str, str]:
        """``(module, name)`` where a name used in ``module`` is defined (its own top level, or imported)."""
        tree = self.tree(module)
        for node in tree.body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name == name:
                return module, name
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        return node.module, alias.name
        return module, name

    def cls(self, module: str, name: str) -> Found:
        f = self.top_level(module, name)
        if f is None or not isinstance(f.node, ast.ClassDef):
            raise KeyError(f"class {module}.{name} not found")
        return f

    def mro(self, module: str, name: str) -> list[Found]:
        """The class and its bases that are defined in the wheel (depth first, in base order)."""
        out, todo = [], [(module, name)]
        while todo:
            mod, nm = todo.pop(0)
            try:
                f = self.cls(mod, nm)
            except KeyError:
                continue
            out.append(f)
            for b in f.node.bases:
                bname = b.id if isinstance(b, ast.Name) else (b.attr if isinstance(b, ast.Attribute) else None)
                if bname and bname not in ("object", "Module", "Struct", "Enum", "IntEnum", "ABC"):
                    todo.append(self.resolve_name(f.module, bname))
        return out

    def method(self, module: str, cls: str, name: str) -> Found | None:
        """Method ``name`` of class ``cls`` or of a base defined in the wheel."""
        for f in self.mro(module, cls):
            for node in f.node.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                    return Found(node, f.module, f.path, node.lineno)
        return None

    def attribute(self, module: str, cls: str, name: str) -> Found | None:
        """Where class ``cls`` (or a base in the wheel) defines attribute ``name``: a class-body field/assignment,
        a method/property, or ``self.name = ...`` in one of its methods."""
        for f in self.mro(module, cls):
            for node in f.node.body:
                if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
                    return Found(node, f.module, f.path, node.lineno)
                if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                    return Found(node, f.module, f.path, node.lineno)
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                    return Found(node, f.module, f.path, node.lineno)
            for node in ast.walk(f.node):
                targets = (
                    node.targets
                    if isinstance(node, ast.Assign)
                    else ([node.target] if isinstance(node, ast.AnnAssign) else [])
                )
                for t in targets:
                    if (
                        isinstance(t, ast.Attribute)
                        and t.attr == name
                        and isinstance(t.value, ast.Name)
                        and t.value.id == "self"
                    ):
                        return Found(node, f.module, f.path, node.lineno)
        return None

    def fields(self, module: str, cls: str) -> dict[str, Found]:
        """Annotated class-body fields (dataclass / msgspec Struct) of ``cls`` and its bases."""
        out: dict[str, Found] = {}
        for f in reversed(self.mro(module, cls)):
            for node in f.node.body:
                if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                    out[node.target.id] = Found(node, f.module, f.path, node.lineno)
        return out


def signature_problems(fn: ast.FunctionDef, *, bound: bool, n_positional: int, keywords: list[str]) -> list[str]:
    """Why a call with ``n_positional`` positional arguments and ``keywords`` does not bind to ``fn`` ([] if it
    does). ``bound``: the first parameter (self/cls) is supplied by the call."""
    a = fn.args
    positional = [x.arg for x in a.posonlyargs + a.args]
    n_defaults = len(a.defaults)
    required_pos = positional[: len(positional) - n_defaults]
    if bound:
        positional, required_pos = positional[1:], required_pos[1:]
    kwonly = [x.arg for x in a.kwonlyargs]
    required_kw = [x.arg for x, d in zip(a.kwonlyargs, a.kw_defaults, strict=True) if d is None]
    problems = []
    if n_positional > len(positional) and a.vararg is None:
        problems.append(f"{n_positional} positional arguments, {fn.name} takes {len(positional)}")
    filled = set(positional[:n_positional])
    posonly = {x.arg for x in a.posonlyargs}
    for k in keywords:
        if k in posonly or (k not in positional and k not in kwonly and a.kwarg is None):
            problems.append(f"keyword {k!r} not accepted by {fn.name}")
        if k in filled:
            problems.append(f"{k!r} given twice")
        filled.add(k)
    for r in required_pos + required_kw:
        if r not in filled:
            problems.append(f"required argument {r!r} of {fn.name} not given")
    return problems
