"""The GPU environment (``envs/sglang-gpu.txt`` + ``envs/sglang-gpu-overrides.txt`` + this project) resolves.

A real resolver run (``uv pip compile``, metadata only: nothing is installed or built) for the platform the GPU
env targets, CPython 3.11 on manylinux_2_34 x86_64 (sglang's wheels need glibc 2.34). It fails on any conflict,
e.g. a transformers or tokenizers range of the project that excludes sglang's pins.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3_data.extract import sglang_backend as sx

ROOT = Path(__file__).resolve().parents[2]
TARGET = ["--python-version", "3.11", "--python-platform", "x86_64-manylinux_2_34"]


def compile_env(*extra: str) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "uv",
        "pip",
        "compile",
        "--no-header",
        *TARGET,
        "pyproject.toml",
        "envs/sglang-gpu.txt",
        *extra,
    ]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)


def pins(text: str) -> dict[str, str]:
    return {m.group(1).lower(): m.group(2) for m in re.finditer(r"^([A-Za-z0-9_.\-]+)==(\S+)", text, re.M)}


@pytest.fixture(scope="module")
def resolved():
    out = compile_env("--override", "envs/sglang-gpu-overrides.txt")
    assert out.returncode == 0, f"the GPU environment does not resolve:\n{out.stderr[-4000:]}"
    return pins(out.stdout)


def test_gpu_env_resolves_with_sglangs_torch_and_transformers(resolved):
    assert resolved["sglang"] == sx.SGLANG_VERSION
    override = re.search(r"^torch==(\S+)", (ROOT / "envs/sglang-gpu-overrides.txt").read_text(), re.M).group(1)
    assert resolved["torch"] == override
    # the project's own dependencies come along, within the project's ranges
    for name in ("snakemake", "duckdb", "pyarrow", "pandera", "transformers", "tokenizers", "safetensors"):
        assert name in resolved, name


def test_without_the_override_the_project_torch_pin_conflicts_with_sglang():
    out = compile_env()
    assert out.returncode != 0
    assert "torch==2.13.0" in out.stderr and re.search(r"sglang.*depends on torch==", out.stderr.replace("\n", " "))


def test_vllm_gpu_env_resolves_with_vllms_torch():
    """envs/vllm-gpu.txt with its override and the project: vllm at its pin (>= 0.10.2, return_token_ids), the
    override's torch, the project's own dependencies within their ranges."""
    cmd = [
        sys.executable,
        "-m",
        "uv",
        "pip",
        "compile",
        "--no-header",
        *TARGET,
        "pyproject.toml",
        "envs/vllm-gpu.txt",
        "--override",
        "envs/vllm-gpu-overrides.txt",
    ]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, f"the vLLM GPU environment does not resolve:\n{out.stderr[-4000:]}"
    got = pins(out.stdout)
    want = re.search(r"^vllm==(\S+)", (ROOT / "envs/vllm-gpu.txt").read_text(), re.M).group(1)
    assert got["vllm"] == want and tuple(int(x) for x in want.split(".")[:3]) >= (0, 10, 2)
    override = re.search(r"^torch==(\S+)", (ROOT / "envs/vllm-gpu-overrides.txt").read_text(), re.M).group(1)
    assert got["torch"] == override
    for name in ("snakemake", "duckdb", "pyarrow", "transformers", "tokenizers"):
        assert name in got, name
