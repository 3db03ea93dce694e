"""Shared fixtures: the repository root, a scratch copy of the workflow, and a snakemake runner."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WORKFLOW_FILES = ["Snakefile", "config.yaml", "rules", "scripts", "schemas", "resources", "profiles", "envs", "report"]


def copy_workflow(dest: Path) -> Path:
    """Copy the workflow (not results/, cache/, logs/) into ``dest`` and return it."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in WORKFLOW_FILES:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, dirs_exist_ok=True)
        elif src.exists():
            shutil.copy2(src, dest / name)
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


@pytest.fixture(scope="session", autouse=True)
def _session_limits_dir(tmp_path_factory):
    """The session's own machine-wide request slots (``EAGLE3_LIMITS_DIR``, eagle3_data.backends.limits), for the
    workflow runs of session and module fixtures: none meets a user's runs or another session's; the sets left
    at the end are removed."""
    from eagle3_data.backends.limits import LIMITS_DIR_ENV, HostSlots

    d = tmp_path_factory.mktemp("limits-session")
    old = os.environ.get(LIMITS_DIR_ENV)
    os.environ[LIMITS_DIR_ENV] = str(d)
    yield d
    HostSlots.remove_all(d)
    if old is None:
        os.environ.pop(LIMITS_DIR_ENV, None)
    else:
        os.environ[LIMITS_DIR_ENV] = old


@pytest.fixture(autouse=True)
def limits_dir(tmp_path_factory, monkeypatch) -> Path:
    """Each test's own machine-wide request slots: ``EAGLE3_LIMITS_DIR`` set to a fresh directory (inherited by the
    jobs and workflow runs it starts); the semaphore sets left there at its end are removed."""
    from eagle3_data.backends.limits import LIMITS_DIR_ENV, HostSlots

    d = tmp_path_factory.mktemp("limits")
    monkeypatch.setenv(LIMITS_DIR_ENV, str(d))
    yield d
    HostSlots.remove_all(d)


@pytest.fixture(scope="module")
def server():
    """A fault-injecting OpenAI/OpenRouter-compatible server on loopback (tests/fault_server.py)."""
    from fault_server import FaultServer

    with FaultServer() as fs:
        yield fs


@pytest.fixture
def fs(server):
    """The module's fault server with its default config and zeroed counters."""
    from fault_server import DEFAULTS

    server.app.config.clear()
    server.app.config.update(DEFAULTS)
    server.app.reset()
    return server


@pytest.fixture(scope="session")
def root() -> Path:
    return ROOT


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory) -> Path:
    """A scratch copy of the workflow after one full `snakemake --cores 2` on the embedded default.

    Shared by every test that reads a finished build (a few minutes on 2 cores, paid once per session).
    Tests must not modify it: copy it (``shutil.copytree(demo_run, dest, symlinks=True)``) first.
    """
    wd = copy_workflow(tmp_path_factory.mktemp("demo"))
    proc = run_snakemake(wd, "--cores", "2", timeout=2400)  # minutes on a busy 2-core machine
    (wd / "run.out").write_text(proc.stdout + proc.stderr)
    return wd


@pytest.fixture(autouse=True)
def tokenizer_cache_dir(tmp_path_factory, monkeypatch) -> Path:
    """Each test's own tokenizer cache (``EAGLE3_TOKENIZER_CACHE``, eagle3_data.templates.tokenizer_cache), inherited by the
    jobs it starts: a test sees the loader's warnings and the jobs' cold loads, whatever ran before it."""
    d = tmp_path_factory.mktemp("tokenizer-cache")
    os.chmod(d, 0o700)
    monkeypatch.setenv("EAGLE3_TOKENIZER_CACHE", str(d))
    return d
