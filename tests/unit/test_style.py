"""The code is linted and formatted as pyproject.toml says ([tool.ruff]: pycodestyle and pyflakes, ruff's format;
[tool.snakefmt]: the Snakefile and rules/), the same commands .ci/run runs."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PY = ["src", "tests", "benchmarks", "scripts"]


def _tool(name: str) -> str:
    exe = Path(sys.executable).with_name(name)
    found = str(exe) if exe.exists() else shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed: it is in the test extra (pip install -e '.[test]')")
    return found


@pytest.mark.parametrize(
    "cmd",
    [["ruff", "check", *PY], ["ruff", "format", "--check", *PY], ["snakefmt", "--check", "Snakefile", "rules/"]],
    ids=["ruff-check", "ruff-format", "snakefmt"],
)
def test_code_is_linted_and_formatted(cmd):
    proc = subprocess.run([_tool(cmd[0]), *cmd[1:]], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]


def test_the_linter_fails_on_an_unused_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n")
    proc = subprocess.run(
        [_tool("ruff"), "check", "--config", str(ROOT / "pyproject.toml"), str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1 and "F401" in proc.stdout
