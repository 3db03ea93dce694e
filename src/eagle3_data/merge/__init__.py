"""Merge stage: validated dataset shards -> deduplicated, length-capped, shuffled merged shards, one selection
per validated shard, and a manifest.

Out of core: numpy computes each validated row's keys (md5 of ``input_ids`` and ``loss_mask`` as DuckDB writes
them as VARCHAR, lengths, supervised counts: :func:`.keys.row_keys`, the values of ``sql/merge_row_keys.sql``), DuckDB
plans the merge over those keys, ids and hashes (``sql/merge_plan.sql``), then streams the kept rows in shard
order (``sql/merge_rows.sql``, an external sort that spills to disk past ``memory_limit``) into one parquet
writer per merged shard while a second thread writes each selection straight from its validated file (the kept
rows of ``sql/merge_selection_plan.sql``, in file order: the rows of ``sql/merge_selection_rows.sql``). Python
never holds more than a record batch of token ids per thread.

Selections are what extraction forwards: one job per validated shard, re-run only when the manifest's digest
of its selection (``sql/merge_selections.sql``) changes, so adding a dataset or retrying a request costs the
GPU only the samples it changed, while the shuffle stays global. The merged shards are the shuffled order
(the exports follow it); their ``source`` column says which selection, hence which hidden-states file, holds
each row.

Determinism: a sample's place depends only on ``(seed, dataset, sample_id)`` (shuffle key
``md5(seed, dataset, sample_id)``) and dedup keeps the first of equal ``input_ids`` in
``(dataset, sample_id)`` order, so the merged shards hold the same rows in the same order whatever the number
or order of the input files (only ``source`` names them).

Held-out set (``merge.heldout`` = f in [0, 1), 0: off): among the rows that survive dedup, the supervision and
the length rules, a row is held out when :func:`heldout_draw` of ``(seed, key)`` is below f, i.e.
``int(md5(f"{seed}\\x1fheldout\\x1f{key}").hexdigest()[:8], 16) / 2**32 < f`` with ``key`` the ``prompt_key`` of
the row's prompt (:func:`eagle3_data.normalize.prompt_key`: its user text, case, punctuation and spacing ignored,
read from the PROMPTS files), else (a pre-tokenized dataset) the ``sample_id`` without a trailing ``@<turn>``
(:func:`base_id`; generation mode ``all`` writes one row per turn: a conversation's turns go together). The draw
depends on nothing else: not the dataset or the id (copies of one prompt, in two datasets built from the same
source or under other ids, fall on the same side), not the other rows, the shard counts or the input files
(adding data moves no sample in or out). Held-out rows are never in
the merged shards; they are written, in the same shuffle-key order, to their own MERGED file (``heldout_path``),
and ``max_samples`` caps count training rows only. They stay in the selections (extraction covers both sets, and
a change of f alone leaves every selection's digest as it was, unless a ``max_samples`` cap then admits other
training rows).
"""

from .stage import (  # noqa: F401
    OVERFLOW_MODES,
    MergeResources,
    base_id,
    heldout_draw,
    memory_limit_of,
    merge,
    remove_leftover_heldout,
    source_key,
)
from .write import HELDOUT_RULE, check_merged_batch  # noqa: F401
