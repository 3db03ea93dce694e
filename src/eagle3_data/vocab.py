"""Draft vocabulary: token frequencies over supervised tokens and the ``d2t``/``t2d`` maps of an EAGLE-3 draft.

Convention (SpecForge ``process_token_dict_to_mappings``, read by its trainer and by SGLang's EAGLE-3 draft
loading):

- the draft vocabulary is the ``draft_vocab_size`` most frequent target ids over tokens with ``loss_mask == 1``
  (ties: lower id first, so the result does not depend on input order), sorted by target id;
- when the corpus has fewer distinct supervised ids than ``draft_vocab_size``, the lowest unused target ids are
  added with frequency 0 (SpecForge PR #76);
- ``d2t`` [draft_vocab_size] int64: ``d2t[i] = used[i] - i`` (an OFFSET: target id = ``i + d2t[i]``);
- ``t2d`` [target_vocab_size] bool: True at the target ids in the draft vocabulary.
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import duckdb
import numpy as np
import pyarrow as pa

from .files import atomic_path, write_json, write_parquet

if TYPE_CHECKING:
    from .settings import VocabSettings

log = logging.getLogger("eagle3_data.vocab")

FREQ_SCHEMA = pa.schema([("token_id", pa.int64()), ("count", pa.int64())])


def token_frequencies(merged_paths, *, threads: int | None = None) -> pa.Table:
    """Count each target id over supervised positions (``loss_mask == 1``) of the MERGED parquet files.

    DuckDB, out of core: ``input_ids`` and ``loss_mask`` are unnested side by side. Returns a table
    ``token_id`` int64, ``count`` int64, sorted by count descending then id. Raises ValueError on no files.
    """
    files = [str(p) for p in ([merged_paths] if isinstance(merged_paths, (str, Path)) else merged_paths)]
    if not files:
        raise ValueError("vocab: no merged files to count tokens in")
    with contextlib.closing(duckdb.connect()) as con:
        if threads:
            con.execute(f"SET threads = {int(threads)}")
        tbl = con.sql(
            """
            SELECT id::BIGINT AS token_id, count(*)::BIGINT AS count
            FROM (SELECT unnest(input_ids) AS id, unnest(loss_mask) AS m FROM read_parquet(?))
            WHERE m = 1
            GROUP BY id
            ORDER BY count DESC, token_id
            """,
            params=[files],
        ).to_arrow_table()
    return tbl.cast(FREQ_SCHEMA)


def draft_vocab_maps(token_ids, counts, draft_vocab_size: int, target_vocab_size: int) -> dict:
    """``d2t``/``t2d`` (torch tensors) and figures for a draft vocabulary of ``draft_vocab_size`` ids.

    Args: ``token_ids``/``counts`` (equal-length int sequences, ids unique), the two vocabulary sizes.
    Returns ``{d2t [D] int64, t2d [V] bool, used [D] int64 (sorted target ids), padded (ids added with
    count 0), coverage (share of supervised tokens the draft vocabulary covers)}``.
    Raises ValueError: draft larger than target vocab, an id outside ``[0, target_vocab_size)``.
    """
    import torch

    D, V = int(draft_vocab_size), int(target_vocab_size)
    if not 1 <= D <= V:
        raise ValueError(f"vocab: draft_vocab_size must be in [1, target vocab size {V}], got {D}")
    ids = np.asarray(token_ids, dtype=np.int64)
    cnt = np.asarray(counts, dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= V):
        bad = int(ids[(ids < 0) | (ids >= V)][0])
        raise ValueError(f"vocab: token id {bad} outside the target vocabulary [0, {V})")
    order = np.lexsort((ids, -cnt))  # count descending, then id ascending
    top = ids[order][:D]
    padded = 0
    if top.size < D:
        have = np.zeros(V, dtype=bool)
        have[top] = True
        extra = np.flatnonzero(~have)[: D - top.size]  # the lowest unused ids, count 0
        padded = int(extra.size)
        top = np.concatenate([top, extra])
    used = np.sort(top)
    total = int(cnt.sum())
    covered = int(cnt[np.isin(ids, used)].sum()) if total else 0
    d2t = torch.from_numpy(used - np.arange(D, dtype=np.int64))
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[torch.from_numpy(used)] = True
    return {
        "d2t": d2t,
        "t2d": t2d,
        "used": torch.from_numpy(used),
        "padded": padded,
        "coverage": covered / total if total else 0.0,
    }


def target_vocab_size(model_path) -> int:
    """``vocab_size`` of the target's ``config.json`` (also under ``text_config``); KeyError if absent."""
    cfg = json.loads((Path(model_path) / "config.json").read_text())
    for sub in (cfg, cfg.get("text_config") or {}, cfg.get("language_config") or {}):
        if "vocab_size" in sub:
            return int(sub["vocab_size"])
    raise KeyError(f"{model_path}/config.json has no vocab_size")


def build_vocab(
    merged_paths,
    out_path,
    freq_path=None,
    summary_path=None,
    *,
    settings: "VocabSettings",
    target_vocab: int | None = None,
) -> dict:
    """Count supervised tokens in the merged shards and write the draft vocabulary map.

    Args:
        merged_paths: MERGED parquet files (the workflow passes the training shards: the draft vocabulary is the
            training set's, the held-out file of ``merge.heldout`` is left out).
        out_path: ``torch.save({"d2t", "t2d"})`` file (SpecForge's ``vocab_mapping.pt`` keys), atomic.
        freq_path: optional parquet of the frequencies (``token_id``, ``count``).
        summary_path: optional JSON: sizes, distinct ids, padded ids, coverage, top 20 ids.
        settings: :class:`~eagle3_data.settings.VocabSettings`: ``draft_vocab_size`` (size of the draft
            vocabulary; SpecForge configs use 32000) and ``model_path`` (the target directory: its config.json's
            ``vocab_size`` is the target vocabulary unless ``target_vocab`` is given; None: give ``target_vocab``).
        target_vocab: the target vocabulary size, or None (read from ``settings.model_path``).

    Returns: the summary dict.
    """
    import torch

    draft_vocab_size, model_path = settings.draft_vocab_size, settings.model_path
    if target_vocab is None:
        if model_path is None:
            raise ValueError("vocab: give model_path or target_vocab")
        target_vocab = target_vocab_size(model_path)
    freq = token_frequencies(merged_paths)
    ids = freq.column("token_id").to_numpy()
    cnt = freq.column("count").to_numpy()
    maps = draft_vocab_maps(ids, cnt, draft_vocab_size, target_vocab)
    with atomic_path(out_path) as tmp:
        torch.save({"d2t": maps["d2t"], "t2d": maps["t2d"]}, tmp)
    if freq_path is not None:
        write_parquet(freq, freq_path)
    summary = {
        "draft_vocab_size": int(draft_vocab_size),
        "target_vocab_size": int(target_vocab),
        "distinct_supervised_ids": int(len(ids)),
        "supervised_tokens": int(cnt.sum()),
        "padded_ids": maps["padded"],
        "coverage": round(maps["coverage"], 6),
        "top_ids": [[int(i), int(c)] for i, c in zip(ids[:20], cnt[:20])],
        "convention": "d2t[i] = used[i] - i (target id = i + d2t[i]); t2d bool over the target vocabulary",
    }
    if summary_path is not None:
        write_json(summary, summary_path)
    log.info(
        "draft vocabulary %d of %d ids: %d distinct supervised ids, %d padded, covers %.2f%% of supervised tokens",
        draft_vocab_size,
        target_vocab,
        len(ids),
        maps["padded"],
        100 * maps["coverage"],
    )
    return summary
