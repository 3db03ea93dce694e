"""Extract stage, SGLang backend: large targets (tensor parallel over the job's GPUs), same output file.

Importable without SGLang: every ``sglang`` import is inside the functions that need it. Install the GPU env
(``envs/sglang-gpu.yaml``) to run it. The approach is SpecForge's offline capture
(SpecForge's ``specforge/offline_capture/sglang_backend``): an in-process SGLang ``ModelRunner``
per tensor-parallel rank (``sglang.bench_one_batch.load_model``), ``set_eagle3_layers_to_capture(layers)``
(SGLang captures the OUTPUT of 0-based decoder layer i, our convention) and the logits processor wrapped so
a prefill returns both the auxiliary states (``hidden_states`` under ``CaptureHiddenMode.FULL``) and the
post-norm final state (the logits processor's input), without sampling anything.

Correctness guards (the anchors' bugs):

- no prefix / radix cache: requests are built with ``tree_cache=None`` and the server args set
  ``disable_radix_cache`` (a cached prefix makes the capture come back short, SpecForge commit c7fc438e);
- no chunked prefill (``chunked_prefill_size=-1``) and no speculative decoding (it truncates captures,
  sglang #26163);
- every capture's length is checked against its input length before anything is written
  (:func:`check_capture`), and the file is written under a temporary name and renamed when complete.

The version-specific part (building a ``ScheduleBatch`` and running one prefill) is isolated in
:class:`SglangRunner`; it follows sglang 0.5 internals and is exercised only by the GPU test
(``tests/test_extract_sglang.py``, ``@pytest.mark.gpu``).
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import numpy as np

from .extract import (FORMAT, LAYER_CONVENTION, HiddenStateWriter, MergedShard, resolve_layers)

log = logging.getLogger("eagle3_data.extract_sglang")


def sglang_available() -> bool:
    """Whether ``sglang`` can be imported in this environment."""
    import importlib.util

    return importlib.util.find_spec("sglang") is not None


def server_args(model_path, *, tp_size: int = 1, dtype: str = "bfloat16", batch_tokens: int = 16384,
                max_len: int = 8192, mem_fraction_static: float = 0.8, trust_remote_code: bool = False,
                max_running_requests: int = 256) -> dict:
    """Keyword arguments of ``sglang.srt.server_args.ServerArgs`` for capture.

    Radix/prefix cache off, chunked prefill off, CUDA graphs off (prefill only), hidden states returned,
    no tokenizer (ids go in as they are), context at least ``max_len`` + 1, KV pool sized for one batch of
    ``batch_tokens`` tokens.
    """
    if tp_size < 1:
        raise ValueError(f"sglang tp_size must be >= 1, got {tp_size}")
    return {
        "model_path": str(model_path),
        "tp_size": int(tp_size),
        "dtype": dtype,
        "trust_remote_code": bool(trust_remote_code),
        "disable_radix_cache": True,
        "chunked_prefill_size": -1,
        "disable_cuda_graph": True,
        "enable_return_hidden_states": True,
        "skip_tokenizer_init": True,
        "context_length": int(max_len) + 1,
        "max_total_tokens": max(int(batch_tokens), int(max_len) + 1),
        "max_running_requests": int(max_running_requests),
        "mem_fraction_static": float(mem_fraction_static),
        "speculative_algorithm": None,
    }


def token_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Sample indices in batches of at most ``batch_tokens`` REAL tokens (SGLang packs ragged sequences,
    so no padding is computed); a longer sample goes alone. Longest first, like the transformers backend."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    out: list[list[int]] = []
    cur: list[int] = []
    used = 0
    for i in order:
        if cur and used + lengths[i] > batch_tokens:
            out.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += lengths[i]
    if cur:
        out.append(cur)
    return out


def check_capture(sample_ids: list[str], input_lens: list[int], aux_list, final_list, num_aux: int,
                  hidden_size: int, source: str = "<shard>") -> None:
    """Raise RuntimeError unless every capture has exactly its input's length and the expected widths.

    A short capture is what prefix caching or chunking produce; it must never reach the file.
    """
    if len(aux_list) != len(input_lens) or len(final_list) != len(input_lens):
        raise RuntimeError(f"{source}: {len(aux_list)}/{len(final_list)} captures for {len(input_lens)} samples")
    for sid, n, a, f in zip(sample_ids, input_lens, aux_list, final_list):
        if a.shape[0] != n or f.shape[0] != n:
            raise RuntimeError(
                f"{source}: sample {sid!r}: captured {a.shape[0]} aux / {f.shape[0]} final rows for {n} input "
                "tokens (capture length must equal input length; is the radix/prefix cache off?)"
            )
        if a.shape[-1] != num_aux * hidden_size or f.shape[-1] != hidden_size:
            raise RuntimeError(
                f"{source}: sample {sid!r}: captured widths {a.shape[-1]} / {f.shape[-1]}, expected "
                f"{num_aux * hidden_size} / {hidden_size}"
            )


class SglangRunner:
    """One tensor-parallel rank of an in-process SGLang model runner that returns captures per prefill.

    ``capture(list_of_id_lists) -> (aux_list, final_list)`` (torch tensors on the GPU, one per sample).
    Rank 0's results are the ones written; other ranks only take part in the forward.
    """

    def __init__(self, args: dict, layers: list[int], tp_rank: int = 0, port_args=None):
        import torch.nn as nn
        from sglang.bench_one_batch import load_model
        from sglang.srt.entrypoints.engine import _set_envs_and_config
        from sglang.srt.layers.logits_processor import LogitsProcessor
        from sglang.srt.server_args import PortArgs, ServerArgs

        self.server_args = ServerArgs(**{k: v for k, v in args.items() if v is not None})
        _set_envs_and_config(self.server_args)
        self.port_args = port_args or PortArgs.init_new(self.server_args)
        self.runner, _ = load_model(self.server_args, self.port_args, tp_rank)
        model = self.runner.model

        class _KeepFinal(nn.Module):  # the logits processor's input is the post-norm final state
            def __init__(self, inner):
                super().__init__()
                self.inner = inner

            def forward(self, input_ids, hidden_states, lm_head, logits_metadata, aux_hidden_states=None, **kw):
                ret = self.inner(input_ids, hidden_states, lm_head, logits_metadata, aux_hidden_states, **kw)
                ret.last_hidden_states = hidden_states
                return ret

        for name, sub in list(model.named_modules()):
            if isinstance(sub, LogitsProcessor):
                parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
                setattr(parent, name.rsplit(".", 1)[-1], _KeepFinal(sub))
        target = model if hasattr(model, "set_eagle3_layers_to_capture") else getattr(model, "language_model", None)
        if target is None or not hasattr(target, "set_eagle3_layers_to_capture"):
            raise ValueError(f"{type(model).__name__}: SGLang model has no set_eagle3_layers_to_capture")
        target.set_eagle3_layers_to_capture(list(layers))

    def capture(self, id_lists: list[list[int]]):
        import torch
        from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch
        from sglang.srt.sampling.sampling_params import SamplingParams
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        sp = SamplingParams(temperature=0, max_new_tokens=1, top_k=1)
        reqs = []
        for k, ids in enumerate(id_lists):
            req = Req(rid=str(k), origin_input_text="", origin_input_ids=list(ids), sampling_params=sp)
            req.prefix_indices = []  # nothing reused: the whole sequence is computed
            req.fill_ids = req.origin_input_ids
            req.extend_input_len = len(req.fill_ids)
            req.logprob_start_len = len(req.origin_input_ids) - 1
            reqs.append(req)
        batch = ScheduleBatch.init_new(
            reqs=reqs, req_to_token_pool=self.runner.req_to_token_pool,
            token_to_kv_pool_allocator=self.runner.token_to_kv_pool_allocator, tree_cache=None,
            model_config=self.runner.model_config, enable_overlap=False,
            spec_algorithm=SpeculativeAlgorithm.NONE, enable_custom_logit_processor=False,
        )
        batch.prepare_for_extend()
        fb = ForwardBatch.init_new(batch.get_model_worker_batch(), self.runner)
        fb.capture_hidden_mode = CaptureHiddenMode.FULL
        with torch.inference_mode():
            out = self.runner.forward(fb)
        logits_output = out[0] if isinstance(out, tuple) else getattr(out, "logits_output", out)
        lens = [len(x) for x in id_lists]
        aux = torch.split(logits_output.hidden_states, lens, dim=0)
        fin = torch.split(logits_output.last_hidden_states, lens, dim=0)
        self.runner.req_to_token_pool.clear()
        self.runner.token_to_kv_pool_allocator.clear()
        return list(aux), list(fin)


def extract_sglang(
    merged_path,
    out_path,
    *,
    model_path,
    layers=None,
    dtype: str = "bfloat16",
    batch_tokens: int = 16384,
    tp_size: int = 1,
    final_states: str = "all",
    aux_format: str = "same",
    mem_fraction_static: float = 0.8,
    trust_remote_code: bool = False,
    capture=None,
) -> dict:
    """Run the target under SGLang over one merged shard; write the extract file (``extract`` layout).

    Args: as :func:`eagle3_data.extract.extract`, plus ``tp_size`` (tensor-parallel ranks = the job's GPUs;
    ranks 1.. run in spawned processes), ``mem_fraction_static``, ``trust_remote_code``; ``capture``: a
    callable ``capture(id_lists) -> (aux_list, final_list)`` replacing the SGLang runner (tests). The final
    state is post-norm (the logits processor's input).

    Returns: the same summary dict as ``extract`` (``backend: sglang``).

    Raises: ImportError (no sglang and no ``capture``), RuntimeError (a capture shorter or longer than its
    input: no file is written), ValueError (bad layers / ids).
    """
    from .plan import model_dims

    t0 = time.perf_counter()
    shard = MergedShard(merged_path)
    dims = model_dims(model_path)
    L, H = dims["num_layers"], dims["hidden_size"]
    chosen = resolve_layers(layers, L)
    procs = []
    if capture is None:
        if not sglang_available():
            raise ImportError("extract backend sglang needs the sglang package (envs/sglang-gpu.yaml)")
        args = server_args(model_path, tp_size=tp_size, dtype=dtype, batch_tokens=batch_tokens,
                           max_len=max(shard.lengths or [1]), mem_fraction_static=mem_fraction_static,
                           trust_remote_code=trust_remote_code)
        runner, procs = _start_ranks(args, chosen, tp_size, shard, batch_tokens)
        capture = runner.capture
    metadata = {
        "format": FORMAT, "backend": "sglang", "model_path": str(model_path), "model_name": Path(model_path).name,
        "model_type": dims["model_type"], "num_layers": str(L), "layers": json.dumps(chosen),
        "layer_convention": LAYER_CONVENTION, "final_norm": "post", "sample_ids": json.dumps(shard.sample_ids),
        "datasets": json.dumps(shard.datasets), "source": str(merged_path), "tp_size": str(tp_size),
    }
    batches = token_batches(shard.lengths, batch_tokens)
    t_model = time.perf_counter()
    done = 0
    try:
        with HiddenStateWriter(out_path, shard, hidden_size=H, num_aux=len(chosen), dtype=dtype,
                               final_states=final_states, aux_format=aux_format, metadata=metadata) as writer:
            for b, idx in enumerate(batches):
                id_lists = [shard.sample_ids_of(i).astype(np.int64).tolist() for i in idx]
                aux_list, fin_list = capture(id_lists)
                check_capture([shard.sample_ids[i] for i in idx], [shard.lengths[i] for i in idx], aux_list,
                              fin_list, len(chosen), H, str(merged_path))
                for i, a, f in zip(idx, aux_list, fin_list):
                    writer.write(i, a.cpu(), f.cpu())
                    done += shard.lengths[i]
                log.info("extract[sglang] %s: batch %d/%d, %d/%d tokens", Path(out_path).name, b + 1, len(batches),
                         done, shard.T)
    finally:
        for p in procs:
            p.terminate()
            p.join(timeout=30)
    model_s = time.perf_counter() - t_model
    return {
        "path": str(out_path), "num_samples": shard.n, "num_tokens": shard.T, "layers": chosen, "hidden_size": H,
        "dtype": dtype, "device": "cuda", "devices": os.environ.get("CUDA_VISIBLE_DEVICES", "").split(","),
        "batches": len(batches), "seconds": round(time.perf_counter() - t0, 3), "model_seconds": round(model_s, 3),
        "tokens_per_s": round(shard.T / model_s, 1) if model_s > 0 else None, "bytes": os.path.getsize(out_path),
        "final_rows": writer.S, "final_states": final_states, "aux_format": aux_format, "final_norm": "post",
        "backend": "sglang",
    }


def _rank_worker(args: dict, layers: list[int], tp_rank: int, port_args, batches: list[list[list[int]]]) -> None:
    """Ranks 1..tp-1: load their model shard and run the same prefills as rank 0 (results discarded)."""
    runner = SglangRunner(args, layers, tp_rank, port_args)
    for id_lists in batches:
        runner.capture(id_lists)


def _start_ranks(args: dict, layers: list[int], tp_size: int, shard: MergedShard, batch_tokens: int):
    """Rank 0 in this process, ranks 1.. in spawned processes fed the same batches in the same order."""
    import multiprocessing as mp

    from sglang.srt.server_args import PortArgs, ServerArgs

    port_args = PortArgs.init_new(ServerArgs(**{k: v for k, v in args.items() if v is not None}))
    procs = []
    if tp_size > 1:
        batches = [[shard.sample_ids_of(i).astype(np.int64).tolist() for i in idx]
                   for idx in token_batches(shard.lengths, batch_tokens)]
        ctx = mp.get_context("spawn")
        for r in range(1, tp_size):
            p = ctx.Process(target=_rank_worker, args=(args, layers, r, port_args, batches), daemon=True)
            p.start()
            procs.append(p)
    return SglangRunner(args, layers, 0, port_args), procs
