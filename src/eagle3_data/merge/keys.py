"""The merge's per-row keys: for each validated row, the md5 of ``input_ids`` and of ``loss_mask`` as DuckDB
writes the lists as VARCHAR (``[1, 2, 3]``), its length and supervised counts: exactly the rows of
``sql/merge_row_keys.sql``, computed with numpy in threads (the SQL is the fallback for a file with nulls or ids
of 10^6 and above). The merge plan (``sql/merge_plan.sql``) and the selection digests are built on them, so the
values must never change: a changed key would change every selection digest and rerun every extract job.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .. import sql


#: row keys are computed with numpy for ids below this (6 digits + ", " = 8 bytes, one uint64 per id)
_FAST_ID_LIMIT = 10**6
_TEXT_CHUNK = 1 << 20  # values formatted at a time (8 MB of text for ids)
_ID_TEXT: dict = {}  # "text table" of ids 0..n-1: (uint64 per id: its digits and ", " left-aligned, length)


def _id_text_table(n: int) -> tuple[np.ndarray, np.ndarray]:
    """For ids ``0..m-1`` (``m >= n``: a power of two, at most ``_FAST_ID_LIMIT``): each id's decimal digits followed by ``", "``, left-aligned
    in one little-endian ``uint64`` (zero bytes after), and the byte length of that text (``int32``)."""
    m = min(_FAST_ID_LIMIT, 1 << max(16, int(n - 1).bit_length()))
    if _ID_TEXT.get("m", 0) < m:
        text = pc.binary_join_element_wise(pc.cast(pa.array(np.arange(m, dtype=np.int32)), pa.string()), ", ", "")
        lens = np.diff(np.frombuffer(text.buffers()[1], np.int32)[: m + 1])
        table = np.zeros((m, 8), np.uint8)
        table[np.arange(8) < lens[:, None]] = np.frombuffer(text.buffers()[2], np.uint8)[: int(lens.sum())]
        _ID_TEXT.update(m=m, table=table.view(np.uint64).ravel(), lens=lens.astype(np.int32))
    return _ID_TEXT["table"], _ID_TEXT["lens"]


def _list_parts(lists: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """Offsets (int64, rebased to 0, ``len + 1``) and the values (no copy) of a list array without nulls."""
    off = np.frombuffer(lists.buffers()[1], np.int32)[lists.offset : lists.offset + len(lists) + 1].astype(np.int64)
    vals = lists.values.to_numpy(zero_copy_only=False)[off[0] : off[-1]]
    return off - off[0], vals


def row_sums(vals: np.ndarray, rel: np.ndarray) -> np.ndarray:
    """Per-row sums (int64) of int8-sized ``vals`` (|v| <= 128) for rows ``rel[i]:rel[i+1]`` (``rel``: int64
    offsets from 0), empty rows 0."""
    out = np.zeros(len(rel) - 1, np.int64)
    full = np.flatnonzero(rel[1:] > rel[:-1])
    if len(full):  # int32 sums are exact below 2**24 values a batch
        out[full] = np.add.reduceat(vals, rel[full], dtype=np.int32 if len(vals) < 2**24 else np.int64)
    return out


def _md5_rows(buf: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> list[str]:
    """Hex md5 of ``"[" + buf[a:b] + "]"`` for each row ``(a, b)`` of ``starts``/``ends`` (byte positions)."""
    mv = memoryview(buf)
    md5 = hashlib.md5
    out = []
    for a, b in zip(starts.tolist(), ends.tolist()):
        h = md5(b"[")
        h.update(mv[a:b])
        h.update(b"]")
        out.append(h.hexdigest())
    return out


def list_text_md5(lists: pa.Array) -> list[str] | None:
    """Hex md5 of each list as DuckDB writes it as VARCHAR (``md5(l::VARCHAR)``: ``"[3, 0, 17]"``, ``"[]"``),
    computed with numpy; ``None`` (the caller asks DuckDB) for a list array with a null list or value, or a value
    outside ``[0, 10**6)``.

    Args:
        lists: ``list<int8>`` / ``list<int32>`` (or any integer ``list``) array of ``n`` rows.

    Returns: ``n`` 32-character lowercase hex strings, or ``None``.
    """
    if not (pa.types.is_list(lists.type) and pa.types.is_integer(lists.type.value_type)):
        return None
    if lists.null_count or lists.values.null_count:
        return None
    rel, vals = _list_parts(lists)
    if len(vals) and (int(vals.min()) < 0 or int(vals.max()) >= _FAST_ID_LIMIT):
        return None
    out: list[str] = []
    n, r = len(rel) - 1, 0
    while r < n:  # rows in chunks of about _TEXT_CHUNK values: the text buffers stay small
        e = min(n, max(r + 1, int(np.searchsorted(rel, rel[r] + _TEXT_CHUNK, side="right")) - 1))
        out += _text_md5(vals[rel[r] : rel[e]], rel[r : e + 1] - rel[r])
        r = e
    return out


def _text_md5(vals: np.ndarray, rel: np.ndarray) -> list[str]:
    """:func:`list_text_md5` of the rows ``rel[i]:rel[i+1]`` of ``vals`` (values in ``[0, 10**6)``)."""
    if len(vals) and int(vals.max()) <= 9:  # masks: one digit each, "d, " = 3 bytes a value
        buf = np.empty(3 * len(vals), np.uint8)
        buf[0::3] = vals.astype(np.uint8) + 48
        buf[1::3] = 44  # ","
        buf[2::3] = 32  # " "
        pos = 3 * rel
    else:
        table, lens = _id_text_table(int(vals.max()) + 1 if len(vals) else 1)
        text = np.take(table, vals).view(np.uint8)
        buf = text[text != 0]  # every text byte is non-zero, the padding is zero
        pos = np.concatenate([[0], np.cumsum(row_sums(np.take(lens, vals), rel))])
    starts = pos[:-1]
    return _md5_rows(buf, starts, np.maximum(starts, pos[1:] - 2))  # without the last ", "


def _file_row_keys(path: str, max_len: int, datasets: list[str] | None, batch_rows: int) -> pa.Table | None:
    """The ``merge_row_keys`` rows of one validated file (``sql/merge_row_keys.sql``, same values) computed with
    numpy, or ``None`` when a batch holds what :func:`list_text_md5` leaves to DuckDB."""
    cols = ["input_ids", "loss_mask"] + (["dataset"] if datasets is not None else [])
    parts = []
    first = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=batch_rows, columns=cols, use_threads=False):
        rows = np.arange(first, first + batch.num_rows, dtype=np.int64)
        first += batch.num_rows
        if datasets is not None:
            keep = pc.is_in(batch.column("dataset"), pa.array(datasets, pa.string())).fill_null(False)
            batch, rows = batch.filter(keep), rows[keep.to_numpy(zero_copy_only=False)]
        ids, mask = batch.column("input_ids"), batch.column("loss_mask")
        content, masks = list_text_md5(ids), list_text_md5(mask)
        if content is None or masks is None:
            return None
        ids_rel, _ = _list_parts(ids)
        mask_rel, mvals = _list_parts(mask)
        sup = row_sums(mvals, mask_rel)
        cut = sup.copy()
        for r in np.flatnonzero(np.diff(mask_rel) > max_len).tolist():  # rows past max_len: sum of the head
            cut[r] = int(mvals[mask_rel[r] : mask_rel[r] + max_len].sum(dtype=np.int64))
        parts.append(
            pa.table(
                {
                    "filename": pa.array([path] * batch.num_rows, pa.string()),
                    "file_row_number": pa.array(rows, pa.int64()),
                    "content_key": pa.array(content, pa.string()),
                    "mask_key": pa.array(masks, pa.string()),
                    "num_tokens": pa.array(np.diff(ids_rel), pa.int64()),
                    "num_supervised": pa.array(sup, pa.int64()),
                    "num_supervised_cut": pa.array(cut, pa.int64()),
                }
            )
        )
    return pa.concat_tables(parts) if parts else None


def row_keys(
    con, files: list[str], *, max_len: int, datasets: list[str] | None, threads: int | None, batch_rows: int = 1024
) -> dict:
    """Create DuckDB temp table ``merge_row_keys`` (``sql/merge_row_keys.sql``: per row of ``files``, md5 of
    ``input_ids`` and of ``loss_mask`` as VARCHAR, num_tokens, num_supervised, num_supervised_cut; only rows of
    ``datasets`` when given) on connection ``con``, the same values as that query, computed with numpy in
    ``threads`` threads (default: the CPU count) one ``batch_rows`` batch at a time; a file with a null list or
    value, an id outside ``[0, 10**6)`` or a mask value outside 0..9 goes through the query instead.

    Needs the ``validated_files``, ``datasets`` and ``max_len`` variables set on ``con`` (restored after).
    Returns ``{"numpy_files": n, "sql_files": m}``.
    """
    workers = max(1, min(len(files), threads or os.cpu_count() or 1))
    con.execute(
        "CREATE OR REPLACE TEMP TABLE merge_row_keys_np (filename VARCHAR, file_row_number BIGINT, "
        "content_key VARCHAR, mask_key VARCHAR, num_tokens BIGINT, num_supervised BIGINT, "
        "num_supervised_cut BIGINT)"
    )
    slow = []
    with ThreadPoolExecutor(workers) as pool:
        for path, keys in zip(files, pool.map(lambda f: _file_row_keys(f, max_len, datasets, batch_rows), files)):
            if keys is None:
                # (a file with no rows lands here too: the query reads nothing of it)
                slow.append(path)
            else:
                con.register("_merge_row_keys_part", keys)
                con.execute("INSERT INTO merge_row_keys_np SELECT * FROM _merge_row_keys_part")
                con.unregister("_merge_row_keys_part")
    if slow:
        sql.set_variables(con, validated_files=slow)
        con.execute(sql.load("merge_row_keys"))
        sql.set_variables(con, validated_files=files)
        con.execute("INSERT INTO merge_row_keys SELECT * FROM merge_row_keys_np")
    else:
        con.execute("CREATE OR REPLACE TEMP TABLE merge_row_keys AS SELECT * FROM merge_row_keys_np")
    con.execute("DROP TABLE merge_row_keys_np")
    return {"numpy_files": len(files) - len(slow), "sql_files": len(slow)}


def add_image_keys(con, files: list[str], datasets: list[str] | None) -> int:
    """Fold each image row's image digests into its ``content_key`` in ``merge_row_keys``:
    ``md5(content_key || chr(31) || digests)``, ``digests`` = the JSON list of its images' SHA-256s in order (the
    VALIDATED ``images`` column). Two rows with the same ids but other images (one question about two pictures of
    one size) are then no duplicates, and a selection's digest changes when an image does, so its states are
    extracted again. Text rows (and files written before the column existed) keep their keys. Returns the number
    of image rows."""
    import json

    parts = []
    for path in files:
        pf = pq.ParquetFile(path)
        if "images" not in pf.schema_arrow.names:
            continue
        images = pf.read(columns=["images"], use_threads=False).column("images")
        if images.null_count == len(images):  # a text shard: one all-null column read, nothing else
            continue
        rows = np.flatnonzero(pc.is_valid(images).to_numpy(zero_copy_only=False))
        dss = pf.read(columns=["dataset"], use_threads=False).column("dataset").take(pa.array(rows)).to_pylist()
        for r, v, ds in zip(rows.tolist(), images.take(pa.array(rows)).to_pylist(), dss):
            if datasets is None or ds in datasets:
                parts.append((path, r, json.dumps([im["sha256"] for im in json.loads(v)])))
    if parts:
        con.register(
            "_merge_image_keys",
            pa.table(
                {
                    "filename": pa.array([p[0] for p in parts], pa.string()),
                    "file_row_number": pa.array([p[1] for p in parts], pa.int64()),
                    "digests": pa.array([p[2] for p in parts], pa.string()),
                }
            ),
        )
        con.execute(
            "UPDATE merge_row_keys AS k SET content_key = md5(k.content_key || chr(31) || i.digests) "
            "FROM _merge_image_keys AS i WHERE k.filename = i.filename AND k.file_row_number = i.file_row_number"
        )
        con.unregister("_merge_image_keys")
    return len(parts)
