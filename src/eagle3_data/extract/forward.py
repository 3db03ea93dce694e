"""The forward side of one extract job (:mod:`.stage`): the devices it holds (:func:`device_context`), the backend
loaded on them, its batch plan, the first batch's final-norm check and the loop that writes every batch's states
(:class:`Forward`), and the job's forward timings (:class:`ForwardTimer`)."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import TYPE_CHECKING

from ..runtime.tokenprogress import device_label
from .layout import HiddenStateWriter, TokenShard
from .writeback import Writeback

if TYPE_CHECKING:
    from ..settings import ExtractSettings

log = logging.getLogger("eagle3_data.extract")


@contextlib.contextmanager
def device_context(device: str = "auto", gpus: int = 1, lock_dir=None):
    """Resolve ``device`` and, for CUDA, hold ``gpus`` distinct devices for the block (file locks).

    Yields ``(device, device_ids)``: ``device`` is ``"cpu"`` or ``"cuda"`` (``cuda:N`` passed through
    unlocked: the caller chose the device), ``device_ids`` the ``CUDA_VISIBLE_DEVICES`` entries held
    (``[]`` on CPU). ``auto`` means cuda when the machine has a GPU (:func:`devices.visible_pool`, which
    asks ``nvidia-smi`` without initialising CUDA) and torch is a CUDA build, else cpu. If torch already
    initialised CUDA in this process the devices cannot be changed any more: a warning is logged and the
    current ones are used. Raises ValueError for an unknown device string.
    """
    from .. import devices

    if device == "cpu" or device.startswith("cuda:"):
        yield device, []
        return
    if device not in ("auto", "cuda"):
        raise ValueError(f"extract device must be auto, cpu, cuda or cuda:N, got {device!r}")
    import torch

    pool, _ = devices.visible_pool()
    if device == "auto" and (not pool or torch.version.cuda is None):  # no GPU, or a CPU-only torch build
        yield "cpu", []
        return
    if devices.cuda_initialized():
        log.warning("CUDA is already initialised in this process; cannot assign devices, using the current ones")
        yield "cuda", []
        return
    with devices.gpu_devices(gpus, lock_dir=lock_dir) as ids:
        yield "cuda", ids


class Forward:
    """The forward side of one extract job: the backend (loaded on the devices the job holds, closed with
    ``stack``), its batch plan, the first batch's final-norm check, and the run that writes every batch's states,
    each batch's copies and writes overlapping the next batch's forward (``writeback``); fills ``run``."""

    def __init__(
        self,
        shard: TokenShard,
        run: dict,
        s: "ExtractSettings",
        *,
        layers,
        hidden_size,
        model,
        capture,
        stack,
        images: dict[int, str] | None = None,
    ):
        """``s``: the job's settings (backend, dtype, devices, batch size, attention path, fused kernels, final
        norm); ``layers``, ``hidden_size``: the decoder layers captured, the target's width; ``model`` / ``capture``: a loaded target / SGLang stand-in
        (tests); ``stack``: closes the backend and releases the devices; ``images``: the rows with images (row
        index: their ``images`` JSON, :mod:`.vision`), each forwarded alone through the vision tower."""
        self.shard, self.run_info, self.batch_tokens, self.dtype = shard, run, s.batch_tokens, s.dtype
        self.images, self.image_inputs = images or {}, None
        if self.images and s.backend != "transformers":
            raise ValueError(
                f"{shard.path}: {len(self.images)} row(s) with images: only extract.backend transformers passes "
                "images through the target's vision tower"
            )
        if s.backend == "sglang":
            from .sglang_backend import SglangBackend

            if capture is not None:
                dev, ids = "cpu", []
            else:
                device = "cuda" if s.device == "auto" else s.device
                dev, ids = stack.enter_context(device_context(device, s.gpus_per_job, s.gpu_lock_dir))
            be = SglangBackend(
                s.model_path,
                layers=layers,
                dtype=s.dtype,
                tp_size=max(1, len(ids) or s.gpus_per_job),
                batch_tokens=s.batch_tokens,
                max_len=max(shard.lengths),
                trust_remote_code=s.trust_remote_code,
                capture=capture,
            )
        else:
            from .transformers_backend import TransformersBackend

            if model is not None:
                dev, ids = "given", []
            else:
                dev, ids = stack.enter_context(device_context(s.device, s.gpus_per_job, s.gpu_lock_dir))
            be = TransformersBackend(
                s.model_path,
                layers=layers,
                dtype=s.dtype,
                device=dev,
                final_norm=s.final_norm,
                device_map="auto" if dev == "cuda" and len(ids) > 1 else None,
                loaded=model,
                trust_remote_code=s.trust_remote_code,
                attention=s.attention,
                fused=s.fused,
            )
            run["fused"] = be.fused
            if self.images:
                from .vision import ImageInputs

                self.image_inputs = ImageInputs(s.model_path, be.model)
        stack.callback(be.close)
        if be.layers != list(layers) or be.hidden_size != hidden_size:
            raise RuntimeError(
                f"{shard.path}: the loaded target has layers {be.layers} / hidden size "
                f"{be.hidden_size}, its config says {layers} / {hidden_size}"
            )
        self.be, self.ids = be, ids
        self.first = None  # (batch index, captured states) of a batch forwarded before the run
        self.first_s = 0.0  # its wall time (added to the run's model time)
        self.store_post = False
        # CUDA event timing only where this process runs the model (SGLang's ranks run in their own processes)
        self.timer = ForwardTimer(be.device if be.name == "transformers" else "cpu")

    def plan(self, todo: list[int]) -> None:
        """Plan the batches of samples ``todo`` (forgetting a first batch captured for another plan)."""
        sh = self.shard
        self.total = sum(sh.lengths[i] for i in todo)
        text = [i for i in todo if i not in self.images]
        lengths = [sh.lengths[i] for i in text]
        self.batches = [[text[k] for k in b] for b in self.be.batches(lengths, self.batch_tokens)] if text else []
        self.batches += [[i] for i in todo if i in self.images]  # image rows: one per forward, after the text
        self.first, self.first_s = None, 0.0

    def first_batch_norm_check(self) -> dict:
        """Forward the first batch with a hook on the final norm (its input and output) and find the formula it
        computes (:func:`.norm.check_formulas` on every row of the batch, in the stored dtype); its states are kept
        for :meth:`run`. Returns ``{weight [H] float32, eps, formula ("none": no formula matched), check}``."""
        import torch

        from .norm import check_formulas, norm_params, pick_formula

        norm_module = self.be.decoder.norm
        seen = {}

        def hook(module, args, output):
            seen["pre"], seen["post"] = args[0], output[0] if isinstance(output, (tuple, list)) else output

        handle = norm_module.register_forward_hook(hook)
        t0 = time.perf_counter()
        try:
            with self.timer:
                self.first = (0, self._capture(self.batches[0]))
        finally:
            handle.remove()
        self.first_s = time.perf_counter() - t0
        weight, eps = norm_params(norm_module)
        tdtype = getattr(torch, self.dtype)
        if weight is None or "pre" not in seen:
            check, formula = {}, "none"
        else:
            check = check_formulas(seen["pre"], seen["post"], weight, eps, tdtype)
            formula = pick_formula(check)
        rows = int(seen["pre"].numel() // seen["pre"].shape[-1]) if "pre" in seen else 0
        seen.clear()
        self.store_post = formula == "none"
        if self.store_post:  # the first batch's post-norm rows too (the later batches': in _capture)
            with torch.inference_mode():
                self.first = (0, [(aux, fin, norm_module(fin)) for aux, fin in self.first[1]])
        log.info(
            "final norm %s of %s: formula %s (first batch, %d rows: %s)",
            type(norm_module).__name__,
            self.be.model_name,
            formula,
            rows,
            ", ".join(f"{f} max {v['max_ulp']} ULP, {v['exact_share']:.4f} exact" for f, v in check.items()),
        )
        if formula == "none":
            log.warning(
                "the final norm of %s matches none of the known RMSNorm formulas: its output is stored beside "
                "its input (hidden_states_post), H more values per token",
                self.be.model_name,
            )
        return {
            "weight": weight if weight is not None else torch.zeros(self.be.hidden_size),
            "eps": eps or 0.0,
            "formula": formula,
            "check": {"rows": rows, **check},
        }

    def _capture(self, idx: list[int]):
        if len(idx) == 1 and idx[0] in self.images:
            i = idx[0]
            ids = self.shard.sample_ids_of(i)
            where = f"{self.shard.path}: sample {self.shard.sample_ids[i]!r}"
            states = self.be.capture_image_row(ids, self.image_inputs(ids, self.images[i], where))
        else:
            states = self.be.capture([self.shard.sample_ids_of(i) for i in idx])
        if self.store_post:  # the model's own norm on the rows before it: exactly its output
            import torch

            with torch.inference_mode():
                states = [(aux, fin, self.be.decoder.norm(fin)) for aux, fin in states]
        return states

    def run(self, writer: HiddenStateWriter, *, overlap: bool, out_name: str, progress=None) -> None:
        """Forward the planned batches into ``writer``; ``progress``: a :class:`TokenProgress` told of each batch."""
        sh, be, run, batches = self.shard, self.be, self.run_info, self.batches
        if hasattr(be, "start"):
            be.start([[sh.sample_ids_of(i).astype("int64").tolist() for i in b] for b in batches])
        run.update(
            device=str(be.device),
            devices=list(self.ids),
            batches=len(batches),
            attention=getattr(be, "attention", "packed"),
        )
        where = device_label(be.device, self.ids)
        log.info("extract %s: forwarding %d tokens in %d batches on %s", out_name, self.total, len(batches), where)
        if progress is not None:
            progress.start(where)
        timer = self.timer
        sink = Writeback(writer, overlap=overlap)
        t_model = time.perf_counter()
        last_log, done = t_model, 0
        total = self.total
        try:
            for b, idx in enumerate(batches):
                if self.first is not None and self.first[0] == b:
                    states = self.first[1]
                    self.first = None
                else:
                    with timer:
                        states = self._capture(idx)
                sink.put(idx, states)
                del states
                done += sum(sh.lengths[i] for i in idx)
                if progress is not None:
                    progress.update(done)
                now = time.perf_counter()
                if now - last_log > 30 or b == len(batches) - 1:
                    log.info(
                        "extract %s: batch %d/%d, %d/%d tokens forwarded, %.0f tokens/s",
                        out_name,
                        b + 1,
                        len(batches),
                        done,
                        total,
                        done / max(now - t_model, 1e-9),
                    )
                    last_log = now
            sink.close()
        except BaseException:
            sink.abort()
            raise
        run["model_seconds"] = time.perf_counter() - t_model + self.first_s
        run["timing"].update(sink.stats, forward_s=timer.seconds())


class ForwardTimer:
    """Seconds spent in the captures: CUDA events on the current stream on a GPU (the forward runs
    asynchronously; read once at the end), wall time elsewhere."""

    def __init__(self, device):
        import torch

        self.cuda = getattr(device, "type", str(device)).startswith("cuda") and torch.cuda.is_available()
        self.wall = 0.0
        self.events: list = []

    def __enter__(self):
        if self.cuda:
            import torch

            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self.events.append([start, None])
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.wall += time.perf_counter() - self._t0
        if self.cuda:
            import torch

            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.events[-1][1] = end
        return False

    def seconds(self) -> float:
        if not self.cuda or not self.events:
            return self.wall
        self.events[-1][1].synchronize()
        return sum(s.elapsed_time(e) for s, e in self.events if e is not None) / 1000.0
