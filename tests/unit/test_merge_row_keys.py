"""merge_row_keys.row_keys (numpy) gives exactly the rows of sql/merge_row_keys.sql (DuckDB), which the selections'
digests and the dedup are built from; files numpy leaves alone go through the query."""

from __future__ import annotations

import hashlib

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eagle3_data.merge import keys as M
from eagle3_data import sql


def _write(path, ids, masks, datasets=None, ids_type=pa.int32()):
    n = len(ids)
    table = pa.table(
        {
            "sample_id": pa.array([f"s{i}" for i in range(n)]),
            "dataset": pa.array(datasets or ["a"] * n),
            "input_ids": pa.array(ids, pa.list_(ids_type)),
            "loss_mask": pa.array(masks, pa.list_(pa.int8())),
        }
    )
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
    assert (
        con.execute("SELECT md5([3, 0, 17]::INTEGER[]::VARCHAR)").fetchall()[0][0]
        == hashlib.md5(b"[3, 0, 17]").hexdigest()
    )
    # left to DuckDB: nulls, ids out of the table's range
    assert M.list_text_md5(pa.array([[1, None]], pa.list_(pa.int32()))) is None
    assert M.list_text_md5(pa.array([[1], None], pa.list_(pa.int32()))) is None
    assert M.list_text_md5(pa.array([[-1, 2]], pa.list_(pa.int32()))) is None
    assert M.list_text_md5(pa.array([[10**6]], pa.list_(pa.int32()))) is None


def test_row_keys_equal_the_query_with_truncation_empty_lists_and_a_dataset_filter(tmp_path):
    ids = [[1, 2, 3, 4, 5, 6], [], [0], [999_999, 12, 7], [150_000, 42, 1, 9, 9], [8, 8], [77, 78, 79, 80]]
    masks = [[0, 0, 1, 1, 1, 1], [], [0], [1, 1, 0], [0, 0, 0, 0, 1], [1, 0], [1, 1, 1, 1]]
    dss = ["a", "b", "a", "a", "b", "c", "a"]
    files = [
        _write(tmp_path / "x" / "000.parquet", ids, masks, dss),
        _write(tmp_path / "x" / "001.parquet", ids[::-1], masks[::-1], dss[::-1]),
    ]
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
    rows = con.sql(
        "SELECT filename, count(*), min(content_key), max(num_supervised_cut) FROM merge_row_keys GROUP BY 1 ORDER BY 1"
    ).fetchall()
    assert rows == [
        (f, 5, hashlib.md5(f"[{i}, {10 * i}, {100 * i}]".encode()).hexdigest(), 1) for i, f in enumerate(files)
    ]


def _sql_selections(files, keys, settings, k):
    """The selections as sql/merge_selection_rows.sql gives them (the reference the merge's own writer matches)."""
    con = duckdb.connect()
    sql.set_variables(con, validated_files=files, datasets=settings.datasets)
    sql.set_variables(con, max_samples=dict(settings.max_samples or {}))
    con.execute("SET VARIABLE max_len = ?::BIGINT", [settings.max_len])
    con.execute("SET VARIABLE num_shards = ?::BIGINT", [k])
    con.execute("SET VARIABLE overflow = ?::VARCHAR", [settings.overflow])
    con.execute("SET VARIABLE seed = ?::VARCHAR", [str(settings.seed)])
    con.execute("CREATE TEMP TABLE merge_sources (filename VARCHAR, source VARCHAR, idx BIGINT)")
    con.executemany(
        "INSERT INTO merge_sources VALUES (?, ?, ?)", [[f, s, i] for i, (f, s) in enumerate(zip(files, keys))]
    )
    con.execute(sql.load("merge_row_keys"))
    con.execute(sql.load("merge_plan"))
    rows = con.sql(sql.load("merge_selection_rows")).to_arrow_table().to_pylist()
    return [[{c: v for c, v in r.items() if c != "shard"} for r in rows if r["shard"] == i] for i in range(len(files))]


def test_selections_are_the_rows_of_the_selection_query(tmp_path):
    from eagle3_data.merge import MergeResources, merge
    from eagle3_data.settings import MergeSettings

    from test_merge import make_rows, row, write_inputs

    rows = make_rows(300, ["a", "b", "c"], seed=5, max_len=40)
    rows.append(row("b", "b-dup", rows[4]["input_ids"], rows[4]["loss_mask"]))
    files = [str(p) for p in write_inputs(tmp_path, rows, 4, shuffle_seed=3)]
    files.append(_write(tmp_path / "in" / "only_d.parquet", [[1, 2, 3]], [[0, 1, 1]], ["d"]))
    keys = [f"k{i}" for i in range(len(files))]
    truncated = []
    for settings in (
        MergeSettings.defaults(max_len=20, overflow="truncate", seed=1, max_samples={"a": 30}),
        MergeSettings.defaults(max_len=25, overflow="drop", seed=2, datasets=["a", "c"]),
    ):
        sels = [tmp_path / "sel" / f"{i}.parquet" for i in range(len(files))]
        man = merge(
            files,
            [tmp_path / "m" / "0.parquet", tmp_path / "m" / "1.parquet"],
            tmp_path / "m.json",
            settings=settings,
            selections=sels,
            sources=keys,
            resources=MergeResources(batch_rows=16),
        )
        want = _sql_selections(files, keys, settings, 2)
        got = [pq.read_table(p).to_pylist() for p in sels]
        assert got == want
        assert [len(g) for g in got] == [man["selections"][k]["samples"] for k in keys]
        assert (
            sum(map(len, got)) == man["totals"]["samples"]
            and sum(r["truncated"] for g in got for r in g) == (man["totals"]["truncated"])
        )
        truncated.append(man["totals"]["truncated"])
        assert all(pq.read_schema(p).equals(pq.read_schema(tmp_path / "m" / "0.parquet")) for p in sels)
    assert got[-1] == []  # dataset d not selected: an empty selection is still written
    assert truncated[0] > 20 and truncated[1] == 0  # cut rows (truncate) and none (drop) both checked


def test_a_failing_merged_shard_leaves_no_file_of_the_run(tmp_path, monkeypatch):
    from eagle3_data.merge import stage as merge_mod
    from eagle3_data.merge import write as merge_write
    from eagle3_data.settings import MergeSettings

    from test_merge import make_rows, write_inputs

    files = write_inputs(tmp_path, make_rows(300, ["a"], seed=9), 3)
    sels = [tmp_path / "sel" / f"{i}.parquet" for i in range(3)]
    outs = [tmp_path / "m" / f"{i}.parquet" for i in range(2)]

    def broken(table, path="<memory>", first_row=0):
        raise merge_write.schemas.SchemaError("simulated bad batch")

    monkeypatch.setattr(merge_write, "check_merged_batch", broken)
    with pytest.raises(merge_write.schemas.SchemaError, match="simulated bad batch"):
        merge_mod.merge(
            files,
            outs,
            tmp_path / "m.json",
            settings=MergeSettings.defaults(max_len=100, seed=0),
            selections=sels,
            resources=merge_mod.MergeResources(batch_rows=32),
        )
    assert not any(p.exists() for p in outs + sels) and not (tmp_path / "m.json").exists()
    assert not [p for d in ("m", "sel") if (tmp_path / d).exists() for p in (tmp_path / d).iterdir()]


def test_list_text_md5_in_chunks_equals_one_pass(monkeypatch):
    lists = pa.array([[7] * 5, [], [123, 4], [1] * 9, [99_999]], pa.list_(pa.int32()))
    whole = M.list_text_md5(lists)
    monkeypatch.setattr(M, "_TEXT_CHUNK", 3)  # rows longer than a chunk, empty rows, chunk edges
    assert (
        M.list_text_md5(lists)
        == whole
        == [hashlib.md5(("[" + ", ".join(map(str, x)) + "]").encode()).hexdigest() for x in lists.to_pylist()]
    )
