"""How samples are grouped into forward passes. Pure functions of the sample lengths (no torch).

Two budgets, one per way a backend lays a batch out:

- :func:`padded_batches`: rows padded to the batch's longest sample, so the budget is
  ``len(batch) * longest`` (the transformers padded path);
- :func:`packed_batches`: samples concatenated without padding (SGLang's ragged prefill, the transformers
  packed path), so the budget is the sum of real tokens, optionally with a cap on samples per batch
  (SGLang's ``max_running_requests``).

Both sort longest first (ties by index), so batches are deterministic and similar lengths share a batch; a
sample longer than the budget goes alone.
"""

from __future__ import annotations


def _order(lengths: list[int]) -> list[int]:
    return sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))


def padded_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Sample indices in batches whose padded size ``len(batch) * max(lengths in batch)`` stays within
    ``batch_tokens``. Raises ValueError when ``batch_tokens < 1``."""
    if batch_tokens < 1:
        raise ValueError(f"batch_tokens must be >= 1, got {batch_tokens}")
    batches: list[list[int]] = []
    cur: list[int] = []
    cur_max = 0
    for i in _order(lengths):
        n = lengths[i]
        new_max = max(cur_max, n)
        if cur and new_max * (len(cur) + 1) > batch_tokens:
            batches.append(cur)
            cur, new_max = [], n
        cur.append(i)
        cur_max = new_max
    if cur:
        batches.append(cur)
    return batches


def packed_batches(lengths: list[int], batch_tokens: int, max_samples: int | None = None) -> list[list[int]]:
    """Sample indices in batches of at most ``batch_tokens`` REAL tokens and at most ``max_samples`` samples
    (``None``: no cap). Raises ValueError when a budget is < 1."""
    if batch_tokens < 1:
        raise ValueError(f"batch_tokens must be >= 1, got {batch_tokens}")
    if max_samples is not None and max_samples < 1:
        raise ValueError(f"max_samples must be >= 1, got {max_samples}")
    out: list[list[int]] = []
    cur: list[int] = []
    used = 0
    for i in _order(lengths):
        if cur and (used + lengths[i] > batch_tokens or (max_samples is not None and len(cur) >= max_samples)):
            out.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += lengths[i]
    if cur:
        out.append(cur)
    return out
