"""Draft vocabulary: DuckDB frequencies over supervised tokens, SpecForge d2t/t2d, padding."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest
import torch

from eagle3_data import schemas
from eagle3_data.settings import VocabSettings
from eagle3_data import vocab as vb


def merged_file(path, rows):
    table = schemas.from_rows(
        [
            {
                "sample_id": f"s{i}",
                "dataset": "d",
                "input_ids": ids,
                "loss_mask": m,
                "num_tokens": len(ids),
                "num_supervised": sum(m),
                "truncated": False,
            }
            for i, (ids, m) in enumerate(rows)
        ],
        schemas.MERGED,
    )
    schemas.write_checked(table, "merged", path)
    return path


def test_frequencies_count_only_supervised(tmp_path):
    rng = random.Random(0)
    rows = []
    for _ in range(200):
        n = rng.randint(2, 50)
        ids = [int(rng.paretovariate(1.2)) % 400 for _ in range(n)]
        m = [rng.random() < 0.6 for _ in range(n)]
        m[-1] = True
        rows.append((ids, [int(x) for x in m]))
    files = [merged_file(tmp_path / "a.parquet", rows[:120]), merged_file(tmp_path / "b.parquet", rows[120:])]
    expected = Counter(t for ids, m in rows for t, k in zip(ids, m) if k)
    freq = vb.token_frequencies(files)
    got = dict(zip(freq.column("token_id").to_pylist(), freq.column("count").to_pylist()))
    assert got == dict(expected)
    counts = freq.column("count").to_pylist()
    assert counts == sorted(counts, reverse=True)


def test_maps_follow_specforge_convention():
    # counts: id 7 most frequent, then 3 and 9 tied (lower id first), then 1
    ids, counts = [9, 3, 7, 1, 5], [4, 4, 10, 2, 1]
    m = vb.draft_vocab_maps(ids, counts, draft_vocab_size=3, target_vocab_size=12)
    assert m["used"].tolist() == [3, 7, 9]
    assert m["d2t"].dtype == torch.int64 and m["d2t"].tolist() == [3, 6, 7]
    assert (torch.arange(3) + m["d2t"]).tolist() == [3, 7, 9]  # target id = draft index + d2t
    assert m["t2d"].dtype == torch.bool and m["t2d"].shape == (12,)
    assert m["t2d"].nonzero().flatten().tolist() == [3, 7, 9]
    assert m["padded"] == 0 and m["coverage"] == pytest.approx(18 / 21)
    # order of the input does not matter
    m2 = vb.draft_vocab_maps(ids[::-1], counts[::-1], 3, 12)
    assert torch.equal(m["d2t"], m2["d2t"])

    # fewer distinct ids than the draft vocabulary: lowest unused ids added with count 0
    p = vb.draft_vocab_maps([5, 2], [3, 1], draft_vocab_size=5, target_vocab_size=10)
    assert p["used"].tolist() == [0, 1, 2, 3, 5] and p["padded"] == 3
    assert p["d2t"].tolist() == [0, 0, 0, 0, 1] and int(p["t2d"].sum()) == 5
    with pytest.raises(ValueError, match="draft_vocab_size"):
        vb.draft_vocab_maps([1], [1], 20, 10)
    with pytest.raises(ValueError, match="outside"):
        vb.draft_vocab_maps([10], [1], 2, 10)


def test_build_vocab_writes_loadable_map(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 64}}))
    f = merged_file(tmp_path / "m.parquet", [([1, 2, 2, 3, 60], [0, 1, 1, 1, 1]), ([2, 4], [1, 0])])
    s = vb.build_vocab(
        [f],
        tmp_path / "out" / "vocab_mapping.pt",
        tmp_path / "out" / "freq.parquet",
        tmp_path / "out" / "vocab.json",
        settings=VocabSettings.defaults(tmp_path / "model", draft_vocab_size=6),
    )
    assert s["distinct_supervised_ids"] == 3 and s["padded_ids"] == 3 and s["coverage"] == 1.0
    vm = torch.load(tmp_path / "out" / "vocab_mapping.pt", weights_only=True)
    assert set(vm) == {"d2t", "t2d"} and vm["t2d"].shape == (64,) and vm["d2t"].shape == (6,)
    used = (torch.arange(6) + vm["d2t"]).tolist()
    assert used == [0, 1, 2, 3, 4, 60] and vm["t2d"][used].all() and int(vm["t2d"].sum()) == 6
    assert json.loads((tmp_path / "out" / "vocab.json").read_text())["top_ids"][0] == [2, 3]
