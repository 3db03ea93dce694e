"""merge.row_keys (numpy) gives exactly the rows of sql/merge_row_keys.sql (DuckDB), which the selections'
digests and the dedup are built from; files numpy leaves alone go through the query."""

from __future__ import annotations

import hashlib

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eagle3_data import merge as M
from eagle3_data import sql


def _write(path, ids, masks, datasets=None, ids_type=pa.int32()):
    n = len(ids)
    table = pa.table({
        "sample_id": pa.array([f"s{i}" for i in range(n)]),
        "dataset": pa.array(datasets or ["a"] * n),
        "input_ids": pa.array(ids, pa.list_(ids_type)),
        "loss_mask": pa.array(masks, pa.list_(pa.int8())),
    })
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, row_group_size=3)  # several row groups: batches across them
    return str(path)


def _both(files, max_len, datasets=None, batch_rows=2):
    con = duckdb.connect()
    sql.set_variables(con, validated_files=files, datasets=datasets)
    con.execute("SET VARIABLE max_len = ?::BIGINT", [max_len])
    con.execute(sql.load("merge_row_keys"))
    want = con.sql("SELECT * FROM merge_row_keys ORDER BY filename, file_row_number").fetchall()
    how = M.row_keys(con, files, max_len=max_len, datasets=datasets, threads=2, batch_rows=batch_rows)
    got = con.sql("SELECT * FROM merge_row_keys ORDER BY filename, file_row_number").fetchall()
    return want, got, how


def test_list_text_md5_is_md5_of_duckdbs_varchar():
    lists = pa.array([[3, 0, 17], [], [999_999, 10, 100_000, 9], [5]], pa.list_(pa.int32()))
    texts = ["[3, 0, 17]", "[]", "[999999, 10, 100000, 9]", "[5]"]
    assert M.list_text_md5(lists) == [hashlib.md5(t.encode()).hexdigest() for t in texts]
    masks = pa.array([[0, 1, 1], [], [1]], pa.list_(pa.int8()))
    assert M.list_text_md5(masks) == [hashlib.md5(t.encode()).hexdigest() for t in ["[0, 1, 1]", "[]", "[1]"]]
    assert M.list_text_md5(lists.slice(2, 2)) == [hashlib.md5(t.encode()).hexdigest() for t in texts[2:]]
    con = duckdb.connect()
    assert con.execute("SELECT md5([3, 0, 17]::INTEGER[]::VARCHAR)").fetchall()[0][0] == hashlib.md5(b"[3, 0, 17]").hexdigest()
    # left to DuckDB: nulls, ids out of the table's range
    assert M.list_text_md5(pa.array([[1, None]], pa.list_(pa.int32()))) is None
    assert M.list_text_md5(pa.array([[1], None], pa.list_(pa.int32()))) is None
    assert M.list_text_md5(pa.array([[-1, 2]], pa.list_(pa.int32()))) is None
    assert M.list_text_md5(pa.array([[10**6]], pa.list_(pa.int32()))) is None


def test_row_keys_equal_the_query_with_truncation_empty_lists_and_a_dataset_filter(tmp_path):
    ids = [[1, 2, 3, 4, 5, 6], [], [0], [999_999, 12, 7], [150_000, 42, 1, 9, 9], [8, 8], [77, 78, 79, 80]]
    masks = [[0, 0, 1, 1, 1, 1], [], [0], [1, 1, 0], [0, 0, 0, 0, 1], [1, 0], [1, 1, 1, 1]]
    dss = ["a", "b", "a", "a", "b", "c", "a"]
    files = [_write(tmp_path / "x" / "000.parquet", ids, masks, dss),
             _write(tmp_path / "x" / "001.parquet", ids[::-1], masks[::-1], dss[::-1])]
    for max_len in (1, 3, 4, 100):
        for datasets in (None, ["a", "c"], ["zzz"]):
            want, got, how = _both(files, max_len, datasets)
            assert got == want and how == {"numpy_files": 2, "sql_files": 0}
    want, _, _ = _both(files, 3)
    # a row cut at max_len=3 keeps sum(mask[:3]) supervised tokens
    assert [r[4:] for r in want if r[0] == files[0]][:2] == [(6, 4, 1), (0, 0, 0)]


def test_files_numpy_cannot_read_go_through_the_query(tmp_path):
    good = _write(tmp_path / "g.parquet", [[1, 2], [3]], [[0, 1], [1]])
    nulls = _write(tmp_path / "n.parquet", [[1, None], [4, 5]], [[0, 1], [1, 1]])
    big = _write(tmp_path / "b.parquet", [[2**31 - 1, 3], [4]], [[1, 1], [1]], ids_type=pa.int64())
    odd_mask = _write(tmp_path / "m.parquet", [[1, 2], [3, 4]], [[0, 12], [-1, 1]])
    empty = _write(tmp_path / "e.parquet", [], [])
    want, got, how = _both([good, nulls, big, odd_mask, empty], 8)
    assert got == want and len(want) == 8
    assert how == {"numpy_files": 1, "sql_files": 4}
    assert [r[1] for r in want if r[0] == nulls] == [0, 1]


@pytest.mark.parametrize("threads", [1, 3])
def test_row_keys_any_thread_count(tmp_path, threads):
    files = [_write(tmp_path / f"{i}.parquet", [[i, 10 * i, 100 * i]] * 5, [[0, 1, 1]] * 5) for i in range(4)]
    con = duckdb.connect()
    sql.set_variables(con, validated_files=files, datasets=None)
    con.execute("SET VARIABLE max_len = 2::BIGINT")
    M.row_keys(con, files, max_len=2, datasets=None, threads=threads)
    rows = con.sql("SELECT filename, count(*), min(content_key), max(num_supervised_cut) FROM merge_row_keys "
                   "GROUP BY 1 ORDER BY 1").fetchall()
    assert rows == [(f, 5, hashlib.md5(f"[{i}, {10 * i}, {100 * i}]".encode()).hexdigest(), 1)
                    for i, f in enumerate(files)]
