"""Progress snapshots of an extract job for the run-wide view (:mod:`eagle3_data.runtime.stageview`).

Inside a workflow run (:func:`eagle3_data.runtime.run.current`), an extract job writes
``<run dir>/progress/extract.<dataset>.<shard>.json`` (:func:`eagle3_data.runtime.runview.write_snapshot`: a
temporary file renamed over it) when it starts forwarding, at most every ``interval_s`` while it forwards, and
when it ends. Outside a run (a job run by hand, a test) nothing is written.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

KIND = "extract"


def device_label(device, ids=()) -> str:
    """Where a job forwards, in words: ``"cpu"``, ``"cuda:0 (NVIDIA H100 80GB HBM3)"``, with the machine's GPUs
    it holds when they are not the process's own numbering (``"cuda:0 (NVIDIA H100 80GB HBM3) = GPU 3"``), or for
    several ``"cuda:0-3 (4× NVIDIA H100 80GB HBM3) = GPUs 0,1,2,3"``.

    ``device``: a ``torch.device`` or its text (``"cpu"``, ``"cuda"``, ``"cuda:N"``); ``ids``: the
    ``CUDA_VISIBLE_DEVICES`` entries the job holds. The GPU's name is asked of torch only where this process has
    initialised CUDA already (a backend whose model runs in other processes keeps it that way)."""
    text = str(device)
    if not text.startswith("cuda"):
        return text
    ids = [str(i) for i in ids]
    n = max(1, len(ids))
    index = None if isinstance(device, str) else getattr(device, "index", None)
    if index is None and ":" in text:
        index = int(text.split(":", 1)[1])
    first = index or 0
    where = f"cuda:{first}" if n == 1 else f"cuda:{first}-{first + n - 1}"
    name = _gpu_name(first)
    if name:
        where += f" ({name})" if n == 1 else f" ({n}× {name})"
    if ids and ids != [str(i) for i in range(first, first + n)]:
        where += f" = GPU {ids[0]}" if n == 1 else f" = GPUs {','.join(ids)}"
    return where


def _gpu_name(index: int) -> str | None:
    try:
        import torch

        if torch.cuda.is_initialized():
            return torch.cuda.get_device_name(index)
    except Exception:  # a name is a nicety: never a reason to fail a job
        return None
    return None


class TokenProgress:
    """The snapshots of one extract job (see the module docstring).

    Args:
        run_dir: the run directory.
        dataset, shard: the job's selection (the snapshot's name).
        tokens: tokens of the selection (int); reused: those copied from stored states, not forwarded.
        interval_s: the least seconds between two snapshots while forwarding.
    """

    def __init__(self, run_dir, dataset: str, shard: str, *, tokens: int, reused: int, interval_s: float = 2.0):
        self.run_dir, self.dataset, self.shard = run_dir, dataset, shard
        self.tokens, self.reused, self.interval_s = int(tokens), int(reused), float(interval_s)
        self.device = ""
        self.forwarded = 0
        self.t0 = time.monotonic()
        self._last = 0.0

    @classmethod
    def for_output(cls, out_path, *, tokens: int, reused: int) -> "TokenProgress | None":
        """The progress of the extract job writing ``out_path`` (rule extract's
        ``results/hidden_states/<dataset>/<shard>.safetensors``: its folder names the dataset, its stem the shard)
        inside a workflow run; None outside one, or for another output (the plan's throughput measurement, which
        extracts into a temporary file, is no extract job)."""
        from .run import current

        p = Path(out_path)
        run = current()
        if run is None or p.parent.parent.name != "hidden_states":
            return None
        return cls(run.dir, p.parent.name, p.name.split(".", 1)[0], tokens=tokens, reused=reused)

    def snapshot(self, final: bool = False) -> dict:
        """The snapshot: kind, dataset, shard, tokens, reused, forwarded (tokens so far), device (words),
        elapsed_s (since this object was made: the forwarding), updated_at (unix s), final (the job ended), pid."""
        return {
            "kind": KIND,
            "dataset": self.dataset,
            "shard": self.shard,
            "tokens": self.tokens,
            "reused": self.reused,
            "forwarded": self.forwarded,
            "device": self.device,
            "elapsed_s": round(time.monotonic() - self.t0, 3),
            "updated_at": time.time(),
            "final": bool(final),
            "pid": os.getpid(),
        }

    def start(self, device: str) -> None:
        """Forwarding starts on ``device`` (:func:`device_label`)."""
        self.device, self.t0 = device, time.monotonic()
        self.write()

    def update(self, forwarded: int, final: bool = False) -> None:
        """``forwarded`` tokens are done; written when ``interval_s`` passed since the last snapshot, or ``final``."""
        self.forwarded = int(forwarded)
        if final or time.monotonic() - self._last >= self.interval_s:
            self.write(final)

    def write(self, final: bool = False) -> None:
        from .snapshots import write_snapshot

        self._last = time.monotonic()
        write_snapshot(self.run_dir, self.snapshot(final))
