"""SGLang extraction backend: large targets, tensor parallel over the job's GPUs; same file as transformers.

Importable without SGLang: every ``sglang`` import is inside the functions that need it. Install the GPU env
(``envs/sglang-gpu.yaml``) to run it. An in-process SGLang ``ModelRunner`` per tensor-parallel rank captures
the auxiliary layers (``hidden_states`` under ``CaptureHiddenMode.FULL``) and the post-norm final state in one
prefill per batch, without sampling anything.

Correctness guards:

- no prefix / radix cache (a cached prefix makes the capture come back short) and no chunked prefill;
- every capture's length is checked against its input length before anything is written
  (:func:`check_capture`).
"""

from __future__ import annotations

import logging

import numpy as np

from .batching import packed_batches
from .model import model_dims, resolve_layers

log = logging.getLogger("eagle3_data.extract")


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
    ``batch_tokens`` tokens. Raises ValueError when ``tp_size < 1``.
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


def _rank_worker(args: dict, layers: list[int], tp_rank: int, port_args, batches: list[list[list[int]]]) -> None:
    """Ranks 1..tp-1: load their model shard and run the same prefills as rank 0 (results discarded)."""
    runner = SglangRunner(args, layers, tp_rank, port_args)
    for id_lists in batches:
        runner.capture(id_lists)


class SglangBackend:
    """The target under SGLang (GPU), behind the same interface as ``TransformersBackend``.

    Args: ``model_path``, ``layers``, ``dtype``, ``tp_size`` (tensor-parallel ranks = the job's GPUs; ranks
    1.. run in spawned processes), ``batch_tokens``, ``max_len`` (longest sample), ``trust_remote_code``,
    ``mem_fraction_static``; ``capture``: a callable ``capture(id_lists) -> (aux_list, final_list)`` replacing
    the SGLang runner (tests on CPU). Final states are post-norm only.

    Raises ImportError when sglang is missing and no ``capture`` is given.
    """

    name = "sglang"

    def __init__(self, model_path, *, layers=None, dtype: str = "bfloat16", tp_size: int = 1,
                 batch_tokens: int = 16384, max_len: int = 8192, trust_remote_code: bool = False,
                 mem_fraction_static: float = 0.8, capture=None):
        dims = model_dims(model_path)
        self.num_layers, self.hidden_size = dims["num_layers"], dims["hidden_size"]
        self.vocab_size, self.model_type = dims["vocab_size"], dims["model_type"]
        self.model_name = str(model_path).rstrip("/").rsplit("/", 1)[-1]
        self.layers = resolve_layers(layers, self.num_layers)
        self.device = "cuda"
        self.tp_size = int(tp_size)
        self._capture = capture
        self._procs = []
        self._args = None
        if capture is None:
            if not sglang_available():
                raise ImportError("extract backend sglang needs the sglang package (envs/sglang-gpu.yaml)")
            self._args = server_args(model_path, tp_size=tp_size, dtype=dtype, batch_tokens=batch_tokens,
                                     max_len=max_len, mem_fraction_static=mem_fraction_static,
                                     trust_remote_code=trust_remote_code)

    def batches(self, lengths: list[int], batch_tokens: int) -> list[list[int]]:
        """Packed batches of at most ``batch_tokens`` real tokens (SGLang packs ragged sequences)."""
        return packed_batches(lengths, batch_tokens)

    def start(self, id_batches: list[list[list[int]]]) -> None:
        """Load the runner(s); ranks 1.. are fed ``id_batches`` (the same batches, in the same order)."""
        if self._capture is not None:
            return
        import multiprocessing as mp

        from sglang.srt.server_args import PortArgs, ServerArgs

        port_args = PortArgs.init_new(ServerArgs(**{k: v for k, v in self._args.items() if v is not None}))
        if self.tp_size > 1:
            ctx = mp.get_context("spawn")
            for r in range(1, self.tp_size):
                p = ctx.Process(target=_rank_worker, args=(self._args, self.layers, r, port_args, id_batches),
                                daemon=True)
                p.start()
                self._procs.append(p)
        self._capture = SglangRunner(self._args, self.layers, 0, port_args).capture

    def capture(self, id_lists: list[np.ndarray]) -> list[tuple]:
        """One prefill over ``id_lists``; per sample ``(aux [n, A*H], final [n, H])``. Raises RuntimeError
        when a capture's rows differ from its input's length."""
        lists = [np.asarray(x, dtype=np.int64).tolist() for x in id_lists]
        aux, fin = self._capture(lists)
        check_capture([str(k) for k in range(len(lists))], [len(x) for x in lists], aux, fin, len(self.layers),
                      self.hidden_size)
        return list(zip(aux, fin))

    def close(self) -> None:
        for p in self._procs:
            p.terminate()
            p.join(timeout=30)
        self._procs = []
