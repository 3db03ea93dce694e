"""SGLang extraction backend: large targets, tensor parallel over the job's GPUs; same file as transformers.

Written against ``sglang==`` :data:`SGLANG_VERSION`, the one place the version is pinned (the contract test reads
the wheel of this version and checks that ``envs/sglang-gpu.txt`` installs the same). Importable without SGLang: every ``sglang`` import is inside the
functions that need it. No machine in CI can run SGLang, so ``tests/workflow/test_sglang_contract.py`` reads the pinned
wheel's source and checks every SGLang module, function, keyword, server argument and attribute used here.

How a batch is captured (SGLang's own machinery, nothing patched):

- **Auxiliary states**: SGLang's built-in capture, the server arguments ``enable_return_aux_hidden_states=True``,
  ``speculative_algorithm="EAGLE3"`` (names the capture convention; no draft model is loaded) and
  ``return_aux_hidden_state_layer_ids`` (:func:`sglang_layer_ids`), configured when the model loads. With
  ``CaptureHiddenMode.FULL`` the logits processor returns ``hidden_states`` ``[T, A*H]`` with the A layers in
  ASCENDING layer order, which :meth:`SglangBackend.capture` reorders into the ``layers`` order the file's
  metadata records.
- **Final states**: ``last_hidden_states`` ``[T, H]``, the state the logits processor receives: the OUTPUT of the
  final norm (post-norm, as the transformers backend writes with ``final_norm: post``).
- **The prefill**: driven in-process the way the pinned SGLang's maintained one-batch benchmark
  (``sglang/benchmark/one_batch.py``, :data:`UPSTREAM_DRIVER`) does: its ``load_model`` (one ``ModelRunner``
  per tensor-parallel rank, loaded once per job), its request set-up and its ``extend`` (``ScheduleBatch`` ->
  ``prepare_for_extend`` -> ``ForwardBatch`` -> ``ModelRunner.forward``), only without sampling and with the
  full hidden-state capture. :class:`_Rank` and :func:`_prefill` say which bench lines they follow, so a
  version bump is one diff of that one upstream file; the contract test pins the file's SHA-256
  (:data:`UPSTREAM_DRIVER_SHA256`) so the diff cannot be skipped.

Correctness guards: no prefix/radix cache and no chunked prefill (either would make a capture come back short);
a capture whose rows differ from the batch's input tokens is refused before it is split (:func:`check_capture`);
requests per forward are capped at SGLang's running-request limit (:attr:`SglangBackend.max_running_requests`,
passed to SGLang as ``max_running_requests`` and checked against the limit SGLang settles on after loading).
"""

from __future__ import annotations

import itertools
import logging
from pathlib import Path

import numpy as np

from .batching import packed_batches
from .model import LAYER_CONVENTION, model_config, model_dims, resolve_layers

log = logging.getLogger("eagle3_data.extract")

#: The SGLang release this backend is written against (``pip install sglang==<this>``).
SGLANG_VERSION = "0.5.23"
#: The upstream file the prefill below follows, and its SHA-256 in the pinned wheel (checked by the contract
#: test: a new SGLang version fails until someone has read this file's diff and adapted :class:`_Rank` /
#: :func:`_prefill`).
UPSTREAM_DRIVER = "sglang/benchmark/one_batch.py"
UPSTREAM_DRIVER_SHA256 = "f98a8a74300544792d339885ed82d3c8b8d7df6d27534d8bd1b48148cf7669de"

#: Requests per forward unless the caller says otherwise (SGLang's ``max_running_requests``).
DEFAULT_MAX_RUNNING_REQUESTS = 256

# How an SGLang model class turns return_aux_hidden_state_layer_ids into the layers it captures, read from its
# set_eagle3_layers_to_capture in the pinned wheel. The capture at index j is the residual-stream INPUT of
# decoder layer j (= the output of layer j-1; j = 0 would be the embeddings), and nothing follows the last layer.
#: every id + 1: id ``i`` captures the input of layer ``i+1`` = the output of layer ``i`` (llama.py, qwen3.py, ...)
PLUS_ONE = "plus_one"
#: + 1 only when the FIRST id is 1, else the ids as given: id ``i`` then captures the output of layer ``i-1``
#: (deepseek_v2.py ``set_eagle3_layers_to_capture``; Kimi-K2.5 delegates to its DeepSeek-V3 language model)
PLUS_ONE_IF_FIRST_IS_ONE = "plus_one_if_first_is_one"

#: Model families (``config.json`` ``architectures[0]``, the class SGLang loads) with their capture-id rule. Only
#: these are accepted: another family's rule has not been read; add it here after reading its
#: ``set_eagle3_layers_to_capture`` (the contract test then checks the entry against the wheel).
ARCHITECTURE_ID_RULES = {
    "LlamaForCausalLM": PLUS_ONE,
    "MistralForCausalLM": PLUS_ONE,
    "Qwen2ForCausalLM": PLUS_ONE,
    "Qwen3ForCausalLM": PLUS_ONE,
    "Qwen3MoeForCausalLM": PLUS_ONE,
    "Glm4MoeForCausalLM": PLUS_ONE,  # GLM-4.5 / 4.6
    "DeepseekV2ForCausalLM": PLUS_ONE_IF_FIRST_IS_ONE,
    "DeepseekV3ForCausalLM": PLUS_ONE_IF_FIRST_IS_ONE,  # DeepSeek-V3 / R1, Kimi-K2
    "KimiK25ForConditionalGeneration": PLUS_ONE_IF_FIRST_IS_ONE,  # Kimi-K2.5 (its language model is DeepSeek-V3)
    "Glm4MoeLiteForCausalLM": PLUS_ONE_IF_FIRST_IS_ONE,
}


def sglang_available() -> bool:
    """Whether ``sglang`` can be imported in this environment."""
    import importlib.util

    return importlib.util.find_spec("sglang") is not None


def model_architecture(model_path) -> str:
    """``architectures[0]`` of the target's ``config.json`` (or a config dict): the model class SGLang loads.

    Raises KeyError naming the file when the config has no ``architectures``."""
    cfg, where = model_config(model_path)
    archs = cfg.get("architectures") or []
    if not archs:
        raise KeyError(f"{where} has no `architectures`; the SGLang backend needs it to pick the capture-id rule")
    return str(archs[0])


def id_rule(architecture: str) -> str:
    """The capture-id rule (:data:`PLUS_ONE` or :data:`PLUS_ONE_IF_FIRST_IS_ONE`) of an SGLang model class.

    Raises ValueError for a family not in :data:`ARCHITECTURE_ID_RULES`."""
    rule = ARCHITECTURE_ID_RULES.get(architecture)
    if rule is None:
        raise ValueError(
            f"extract backend sglang: no capture-id rule for architecture {architecture!r} (supported: "
            f"{', '.join(sorted(ARCHITECTURE_ID_RULES))}); use extract.backend: transformers, or add the family to "
            "ARCHITECTURE_ID_RULES in eagle3_data/extract/sglang_backend.py after reading its "
            f"set_eagle3_layers_to_capture in sglang=={SGLANG_VERSION}"
        )
    return rule


def sglang_layer_ids(layers: list[int], *, num_layers: int, architecture: str) -> list[int]:
    """SGLang ``return_aux_hidden_state_layer_ids`` that capture the OUTPUT of 0-based decoder layers ``layers``
    (the project's convention, ``model.LAYER_CONVENTION``), ascending.

    - :data:`PLUS_ONE` families: the layers themselves (SGLang adds 1).
    - :data:`PLUS_ONE_IF_FIRST_IS_ONE` families (DeepSeek-V2/V3, Kimi-K2/K2.5): when the smallest layer is 1, the
      layers themselves (SGLang adds 1 because the first id is 1); otherwise every layer + 1 (SGLang keeps them,
      and id ``i`` captures the output of layer ``i-1``).

    Raises ValueError for the last decoder layer (SGLang captures a layer's output as the next layer's input;
    nothing follows the last one), for layer 0 in a :data:`PLUS_ONE_IF_FIRST_IS_ONE` family (its id 1 would come
    first and make SGLang shift every id), for an unknown family, and for ``layers`` outside
    ``[0, num_layers-1]``/repeated (:func:`model.resolve_layers`).
    """
    layers = resolve_layers(layers, num_layers)
    rule = id_rule(architecture)
    if num_layers - 1 in layers:
        raise ValueError(
            f"extract layers {layers}: SGLang cannot capture the last decoder layer ({num_layers - 1}) of "
            f"{architecture} (it captures a layer's output as the next layer's input); drop it or use "
            "extract.backend: transformers"
        )
    ascending = sorted(layers)
    if rule == PLUS_ONE:
        return ascending
    if ascending[0] == 0:
        raise ValueError(
            f"extract layers {layers}: SGLang cannot capture the output of layer 0 of {architecture} (its id 1 "
            "would come first, which makes SGLang add 1 to every id); drop layer 0 or use extract.backend: "
            "transformers"
        )
    return ascending if ascending[0] == 1 else [i + 1 for i in ascending]


def captured_layers(layer_ids: list[int], *, num_layers: int, rule: str) -> list[int]:
    """What SGLang captures for ``return_aux_hidden_state_layer_ids`` = ``layer_ids`` under ``rule``: the
    project-convention layers (output of layer i; ``-1`` = the embeddings) of the returned column blocks, in the
    order SGLang returns them (ascending). A model of the pinned wheel in miniature: the rule's id shift
    (``set_eagle3_layers_to_capture``), then the decoder loop that captures the input of every layer ``j`` in
    ``layers_to_capture`` for ``j`` in ``range(num_layers)``. Raises ValueError for an unknown rule."""
    if rule == PLUS_ONE:
        to_capture = [i + 1 for i in layer_ids]
    elif rule == PLUS_ONE_IF_FIRST_IS_ONE:
        to_capture = [i + 1 for i in layer_ids] if layer_ids and layer_ids[0] == 1 else list(layer_ids)
    else:
        raise ValueError(f"unknown capture-id rule {rule!r}")
    return [j - 1 for j in range(num_layers) if j in to_capture]


def column_order(layers: list[int]) -> list[int]:
    """Indices into SGLang's ascending column blocks that give the blocks in ``layers`` order: block ``k`` of
    the file is block ``column_order(layers)[k]`` of SGLang's capture."""
    ascending = sorted(layers)
    return [ascending.index(x) for x in layers]


def server_args(
    model_path,
    *,
    layer_ids: list[int],
    tp_size: int = 1,
    dtype: str = "bfloat16",
    max_len: int = 8192,
    mem_fraction_static: float = 0.8,
    trust_remote_code: bool = False,
    max_running_requests: int = DEFAULT_MAX_RUNNING_REQUESTS,
) -> dict:
    """Keyword arguments of SGLang's ``ServerArgs`` for capture.

    Auxiliary capture on (:func:`sglang_layer_ids` ids, EAGLE-3 convention), radix/prefix cache off, chunked
    prefill off, CUDA graphs off (prefill only; nothing is decoded), no tokenizer start-up (ids go in as they are),
    context ``max_len`` + 1 (the request pool is sized by it), at most ``max_running_requests`` requests per
    forward. The KV pool is left to SGLang (``mem_fraction_static`` of the GPU after the weights).
    Raises ValueError when ``tp_size`` or ``max_running_requests`` is < 1 or ``layer_ids`` is empty.
    """
    if tp_size < 1:
        raise ValueError(f"sglang tp_size must be >= 1, got {tp_size}")
    if max_running_requests < 1:
        raise ValueError(f"sglang max_running_requests must be >= 1, got {max_running_requests}")
    if not layer_ids:
        raise ValueError("sglang return_aux_hidden_state_layer_ids must not be empty")
    return {
        "model_path": str(model_path),
        "tp_size": int(tp_size),
        "dtype": dtype,
        "trust_remote_code": bool(trust_remote_code),
        "enable_return_aux_hidden_states": True,
        "speculative_algorithm": "EAGLE3",
        "return_aux_hidden_state_layer_ids": [int(i) for i in layer_ids],
        "disable_radix_cache": True,
        "chunked_prefill_size": -1,
        "disable_prefill_cuda_graph": True,
        "disable_decode_cuda_graph": True,
        "skip_tokenizer_init": True,
        "context_length": int(max_len) + 1,
        "max_running_requests": int(max_running_requests),
        "mem_fraction_static": float(mem_fraction_static),
    }


def check_capture(input_lens: list[int], aux, final, num_aux: int, hidden_size: int, source: str = "<batch>") -> None:
    """Raise RuntimeError unless one packed capture (``aux`` ``[T, A*H]``, ``final`` ``[T, H]``) has exactly the
    batch's ``T = sum(input_lens)`` rows and the expected widths. Called before the capture is split per sample:
    a short capture (what a prefix-cache hit or chunking produce) would otherwise shift every later sample."""
    total = int(sum(input_lens))
    if aux.shape[0] != total or final.shape[0] != total:
        raise RuntimeError(
            f"{source}: captured {aux.shape[0]} aux / {final.shape[0]} final rows for {len(input_lens)} samples of "
            f"{total} input tokens (capture length must equal input length; is the radix/prefix cache off?)"
        )
    if aux.dim() != 2 or final.dim() != 2 or aux.shape[1] != num_aux * hidden_size or final.shape[1] != hidden_size:
        raise RuntimeError(
            f"{source}: captured shapes {tuple(aux.shape)} / {tuple(final.shape)}, expected "
            f"({total}, {num_aux * hidden_size}) / ({total}, {hidden_size})"
        )


def forward_spans(lens: list[int], max_requests: int, max_tokens: int) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` consecutive sub-batches of a batch of samples with lengths ``lens``, each within
    ``max_requests`` samples and ``max_tokens`` tokens (SGLang's running-request limit and KV pool after loading).
    One span when the batch fits (the usual case: batches are planned within the limits asked for). Raises
    RuntimeError for a sample longer than ``max_tokens``."""
    spans, start, used = [], 0, 0
    for k, n in enumerate(lens):
        if n > max_tokens:
            raise RuntimeError(
                f"sglang: a sample of {n} tokens does not fit SGLang's KV pool of {max_tokens} tokens; "
                "give the job more GPU memory (or fewer layers per GPU: more gpus_per_job)"
            )
        if k > start and (k - start >= max_requests or used + n > max_tokens):
            spans.append((start, k))
            start, used = k, 0
        used += n
    spans.append((start, len(lens)))
    return spans


class RankBase:
    """One tensor-parallel rank of the loaded target: ``forward(id_lists) -> (aux [T, A*H], final [T, H])`` is
    one SGLang prefill (aux blocks in ascending layer order, tokens in request order); :meth:`prefill` runs a
    planned batch as one or more forwards within the limits SGLang settled on when it loaded (``max_requests``
    running requests, ``max_tokens`` KV-pool tokens, ``context_len``), the same split on every rank."""

    max_requests: int = 1 << 62
    max_tokens: int = 1 << 62
    context_len: int = 1 << 62

    def forward(self, id_lists: list[list[int]]):
        raise NotImplementedError

    def prefill(self, id_lists: list[list[int]]):
        """``(aux [T, A*H], final [T, H])`` for one planned batch. Raises RuntimeError for a sample that does not
        fit SGLang's context or KV pool."""
        lens = [len(x) for x in id_lists]
        if max(lens) >= self.context_len:
            raise RuntimeError(
                f"sglang: a sample of {max(lens)} tokens does not fit SGLang's context of {self.context_len}"
            )
        outs = [self.forward(id_lists[a:b]) for a, b in forward_spans(lens, self.max_requests, self.max_tokens)]
        if len(outs) == 1:
            return outs[0]
        import torch

        return torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------------------------------------------------
# One tensor-parallel rank: everything below touches SGLang (names checked by tests/workflow/test_sglang_contract.py).
# ---------------------------------------------------------------------------------------------------------------


def _resolved_server_args(args: dict):
    """``ServerArgs`` resolved once, process environment set, ports chosen: one_batch.py ``main`` (it declares a
    decode CUDA-graph size first; nothing is decoded here and CUDA graphs are off)."""
    from sglang.srt.entrypoints.engine import _set_envs_and_config
    from sglang.srt.server_args import PortArgs, ServerArgs

    server_args = ServerArgs(**args)
    server_args.resolve_once()
    _set_envs_and_config(server_args)
    port_args = PortArgs.init_new(server_args)
    return server_args, port_args


class _Rank(RankBase):
    """One tensor-parallel rank of the target in this process: SGLang's ``ModelRunner``, loaded once per job
    (torch tensors on the GPU in the model's dtype)."""

    def __init__(self, server_args, port_args, tp_rank: int, gpu_id: int):
        # one_batch.py latency_test: publish this rank's placement, process-global configs, load_model.
        from sglang.benchmark.one_batch import _init_process_global_configs, load_model
        from sglang.srt.runtime_context import SpawnRanks, publish, spawn_world_rank

        publish(
            server_args,
            role="scheduler",
            ranks=SpawnRanks(world_rank=spawn_world_rank(server_args, tp_rank=tp_rank, pp_rank=0), gpu_id=gpu_id),
        )
        _init_process_global_configs()
        bench, _tokenizer = load_model(server_args, port_args, gpu_id, tp_rank)
        self.runner = bench.torch_runner
        self.tp_rank, self.tp_size = tp_rank, int(server_args.tp_size)
        self.max_requests = int(self.runner.max_running_requests)
        self.max_tokens = int(self.runner.max_total_num_tokens)
        self.context_len = int(self.runner.model_config.context_len)

    def forward(self, id_lists: list[list[int]]):
        return _prefill(self.runner, id_lists)

    def close(self) -> None:
        """Leave the tensor-parallel group (one_batch.py latency_test's end; every rank at once)."""
        if self.tp_size > 1:
            from sglang.srt.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

            destroy_model_parallel()
            destroy_distributed_environment()


def _prefill(runner, id_lists: list[list[int]]):
    """One prefill over ``id_lists`` with full hidden-state capture: ``(aux [T, A*H], final [T, H])``.

    Follows one_batch.py: ``prepare_synthetic_inputs_for_latency_test`` (the requests), ``_TorchBenchRunner.clear``
    (empty pools before the batch) and ``extend`` (the forward), except that ``ForwardBatch`` gets
    ``capture_hidden_mode=FULL`` and nothing is sampled."""
    from array import array

    import torch
    from sglang.benchmark.one_batch import TreeCacheNamespace, _maybe_prepare_mlp_sync_batch
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch
    from sglang.srt.runtime_context import get_schedule
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    runner.req_to_token_pool.clear()
    runner.token_to_kv_pool_allocator.clear()
    sampling_params = SamplingParams(temperature=0, max_new_tokens=1)
    reqs = []
    for k, ids in enumerate(id_lists):
        req = Req(rid=str(k), origin_input_text="", origin_input_ids=array("q", ids), sampling_params=sampling_params)
        req.full_untruncated_fill_ids = req.origin_input_ids
        req.logprob_start_len = -1
        req.extend_end = len(req.origin_input_ids)
        reqs.append(req)
    with torch.no_grad():
        tree_cache = TreeCacheNamespace(
            page_size=get_schedule().page_size,
            device=runner.device,
            token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator,
        )
        batch = ScheduleBatch.init_new(
            reqs=reqs,
            req_to_token_pool=runner.req_to_token_pool,
            token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator,
            tree_cache=tree_cache,
            model_config=runner.model_config,
            enable_overlap=False,
            spec_algorithm=SpeculativeAlgorithm.NONE,
        )
        batch.prepare_for_extend()
        _maybe_prepare_mlp_sync_batch(batch, runner)
        if batch.input_ids is None and getattr(batch, "prefill_input_ids_cpu", None) is not None:
            batch.input_ids = batch.prefill_input_ids_cpu.to(batch.device, non_blocking=True)
            batch.prefill_input_ids_cpu = None
        forward_batch = ForwardBatch.init_new(
            batch, runner, capture_hidden_mode=CaptureHiddenMode.FULL, return_hidden_states_before_norm=False
        )
        logits_output = runner.forward(forward_batch).logits_output
        aux, final = logits_output.hidden_states, logits_output.last_hidden_states
    if aux is None or final is None:
        raise RuntimeError(
            "sglang returned no auxiliary / final hidden states (is enable_return_aux_hidden_states "
            "on and the model's family in ARCHITECTURE_ID_RULES?)"
        )
    return aux, final


def _rank_main(job_file: str, tp_rank: int, gpu_id: int) -> None:
    """Ranks 1..tp-1 (``python -m eagle3_data.extract.sglang_backend JOB_FILE TP_RANK GPU_ID``): load their shard
    and run the same prefills as rank 0, in the same order (their results are discarded: under tensor parallelism
    rank 0 holds the full states). ``JOB_FILE``: a pickle of ``(server_args, port_args, id_batches)``."""
    import pickle

    from sglang.srt.utils import configure_logger

    with open(job_file, "rb") as fh:
        sargs, port_args, id_batches = pickle.load(fh)
    configure_logger(sargs, prefix=f" TP{tp_rank}")
    rank = _Rank(sargs, port_args, tp_rank, gpu_id)
    for batch in id_batches:
        rank.prefill([np.asarray(x).tolist() for x in batch])
    rank.close()


class _StandIn(RankBase):
    """A ``capture(id_lists) -> (aux [T, A*H] ascending, final [T, H])`` callable in place of a loaded rank."""

    def __init__(self, capture):
        self.forward = capture


class SglangBackend:
    """The target under SGLang (GPU), behind the same interface as ``TransformersBackend``.

    Args:
        model_path: local target directory (config, weights, tokenizer); never downloaded.
        layers: auxiliary layers (0-based, OUTPUT of layer i), ``None`` -> EAGLE-3 defaults; order kept in the
            file. Mapped to SGLang ids per model family (:func:`sglang_layer_ids`).
        dtype: SGLang's ``dtype`` (``float32`` | ``bfloat16`` | ``float16``).
        tp_size: tensor-parallel ranks = the job's GPUs (rank 0 in this process, ranks 1.. spawned).
        batch_tokens: the planned real tokens per forward (packed, no padding); a warning when SGLang's KV pool
            turns out smaller (the batch then runs as several forwards).
        max_len: the longest sample of the job (SGLang's context is ``max_len + 1``).
        trust_remote_code: load the target with its own code (Kimi).
        mem_fraction_static: SGLang's share of GPU memory for weights + KV pool.
        max_running_requests: requests per forward (SGLang's running-request limit).
        capture: a stand-in for the loaded SGLang rank, ``capture(id_lists) -> (aux [T, A*H] with the blocks in
            ascending layer order, final [T, H])`` (what SGLang's logits processor returns; tests on CPU).
        rank_factory: ``rank_factory(tp_rank) -> RankBase`` in place of SGLang's ``ModelRunner`` (tests).

    Attributes: ``name`` ("sglang"), ``num_layers``, ``hidden_size``, ``vocab_size``, ``model_type``,
    ``model_name``, ``architecture``, ``layers`` (file order), ``layer_ids`` (SGLang's ids, ascending),
    ``device``, ``tp_size``, ``max_running_requests``, ``loads`` (ranks loaded in this process: 1 per job).

    Raises ValueError (layers SGLang cannot capture for this family, an unsupported family), ImportError (no
    sglang and no stand-in).
    """

    name = "sglang"

    def __init__(
        self,
        model_path,
        *,
        layers=None,
        dtype: str = "bfloat16",
        tp_size: int = 1,
        batch_tokens: int = 16384,
        max_len: int = 8192,
        trust_remote_code: bool = False,
        mem_fraction_static: float = 0.8,
        max_running_requests: int = DEFAULT_MAX_RUNNING_REQUESTS,
        capture=None,
        rank_factory=None,
    ):
        dims = model_dims(model_path)
        self.num_layers, self.hidden_size = dims["num_layers"], dims["hidden_size"]
        self.vocab_size, self.model_type = dims["vocab_size"], dims["model_type"]
        self.model_name = Path(str(model_path)).name if not isinstance(model_path, dict) else "<config>"
        self.architecture = model_architecture(model_path)
        self.layers = resolve_layers(layers, self.num_layers)
        self.layer_ids = sglang_layer_ids(self.layers, num_layers=self.num_layers, architecture=self.architecture)
        self._order = column_order(self.layers)
        self.device = "cuda"
        self.tp_size = int(tp_size)
        self.max_running_requests = int(max_running_requests)
        self.batch_tokens = int(batch_tokens)
        self.loads = 0
        self._args = server_args(
            model_path,
            layer_ids=self.layer_ids,
            tp_size=tp_size,
            dtype=dtype,
            max_len=max_len,
            mem_fraction_static=mem_fraction_static,
            trust_remote_code=trust_remote_code,
            max_running_requests=max_running_requests,
        )
        self._rank = None
        self._procs: list = []
        self._job_file = None
        self._expected = self._done = 0
        if capture is not None:
            self._factory = lambda tp_rank: _StandIn(capture)
        elif rank_factory is not None:
            self._factory = rank_factory
        else:
            if not sglang_available():
                raise ImportError(f"extract backend sglang needs sglang=={SGLANG_VERSION} (envs/sglang-gpu.txt)")
            self._factory = None
        log.info(
            "sglang %s: layers %s (%s) -> SGLang aux ids %s (%s rule)",
            self.architecture,
            self.layers,
            LAYER_CONVENTION,
            self.layer_ids,
            id_rule(self.architecture),
        )

    def batches(self, lengths: list[int], batch_tokens: int) -> list[list[int]]:
        """Packed batches of at most ``batch_tokens`` real tokens and at most ``max_running_requests`` samples."""
        return packed_batches(lengths, batch_tokens, max_samples=self.max_running_requests)

    def start(self, id_batches: list[list[list[int]]]) -> None:
        """Load the target once for the job: rank 0 in this process, ranks 1.. as ``python -m
        eagle3_data.extract.sglang_backend`` processes fed ``id_batches`` (the batches :meth:`capture` will be
        called with, in the same order; they run the same prefills). Idempotent."""
        if self._rank is not None:
            return
        self._expected = len(id_batches)
        if self._factory is not None:
            self._rank = self._factory(0)
            self.loads += 1
            return
        import pickle
        import subprocess
        import sys
        import tempfile

        from sglang.srt.utils import maybe_reindex_device_id

        sargs, port_args = _resolved_server_args(self._args)
        if self.tp_size > 1:
            # Separate interpreters, not multiprocessing: a spawned child would re-run the stage's __main__ (the
            # Snakemake script), and a forked one would inherit the stage's threads.
            fd, self._job_file = tempfile.mkstemp(prefix="eagle3-sglang-", suffix=".pkl")
            with open(fd, "wb") as fh:
                pickle.dump((sargs, port_args, [[np.asarray(x, dtype=np.int64) for x in b] for b in id_batches]), fh)
            for tp_rank in range(1, self.tp_size):
                with maybe_reindex_device_id(tp_rank) as gpu_id:  # one_batch.py main: one process per rank
                    self._procs.append(
                        subprocess.Popen([sys.executable, "-m", __name__, self._job_file, str(tp_rank), str(gpu_id)])
                    )
        self._rank = _Rank(sargs, port_args, 0, 0)
        self.loads += 1
        if self._rank.max_requests < self.max_running_requests or self._rank.max_tokens < self.batch_tokens:
            log.warning(
                "sglang settled on %d running requests / a KV pool of %d tokens (planned %d / %d): larger "
                "batches run as several forwards",
                self._rank.max_requests,
                self._rank.max_tokens,
                self.max_running_requests,
                self.batch_tokens,
            )

    def capture(self, id_lists: list[np.ndarray]) -> list[tuple]:
        """One prefill over ``id_lists`` (1-D int arrays); per sample ``(aux [n, A*H] in layers order,
        final [n, H] post-norm)``, torch tensors in the model dtype on rank 0's GPU.

        A batch over the limits SGLang settled on runs as several forwards (:meth:`RankBase.prefill`). Raises
        RuntimeError when the capture's rows differ from the batch's input tokens (checked before it is split),
        when a tensor-parallel rank process has exited with an error (one that dies during a forward leaves rank 0
        waiting in the collective until torch.distributed's timeout), or when one sample does not fit SGLang's
        context or KV pool."""
        if self._rank is None:
            if self.tp_size > 1:
                raise RuntimeError("SglangBackend.start(id_batches) must run first when tp_size > 1")
            self.start([])
        for p in self._procs:
            if p.poll() not in (None, 0):
                raise RuntimeError(f"sglang tensor-parallel rank process {p.args[-2]} exited with code {p.returncode}")
        lists = [np.asarray(x, dtype=np.int64).tolist() for x in id_lists]
        lens = [len(x) for x in lists]
        aux, fin = self._rank.prefill(lists)
        check_capture(lens, aux, fin, len(self.layers), self.hidden_size)
        self._done += 1
        if self._order != sorted(self._order):
            n = aux.shape[0]
            aux = aux.reshape(n, len(self.layers), self.hidden_size)[:, self._order, :].reshape(n, -1)
        bounds = itertools.pairwise(np.concatenate([[0], np.cumsum(lens)]).astype(int).tolist())
        return [(aux[s:e], fin[s:e]) for s, e in bounds]

    def close(self) -> None:
        """After the last batch: rank 0 and ranks 1.. leave the process group together and the rank processes
        exit. After a failure (fewer batches captured than planned) the rank processes, which would wait for
        rank 0 in a collective, are stopped. Idempotent."""
        import contextlib
        import os
        import subprocess

        finished = self._done >= self._expected
        if self._rank is not None and finished:
            self._rank.close()
        for p in self._procs:
            try:
                p.wait(timeout=120 if finished else 1)
            except subprocess.TimeoutExpired:
                p.terminate()
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
        self._procs = []
        if self._job_file is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._job_file)
            self._job_file = None
        self._rank = None


if __name__ == "__main__":  # a tensor-parallel rank 1.. of SglangBackend.start
    import sys

    _rank_main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
