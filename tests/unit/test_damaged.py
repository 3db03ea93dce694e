"""Damaged stage outputs under results/ are found by a few bytes each, named, and removed (a dry run removes
nothing); whole files, hidden temporaries, exports and reports are left alone."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from safetensors.torch import save_file

from eagle3_data.runtime import damaged


def _tree(root):
    (root / "ds" / "tokens").mkdir(parents=True)
    (root / "hidden_states" / "ds").mkdir(parents=True)
    (root / "export" / "speculators").mkdir(parents=True)
    pq.write_table(pa.table({"x": list(range(1000))}), root / "ds" / "tokens" / "000.parquet")
    save_file({"a": torch.zeros(64, 8), "b": torch.ones(3)}, root / "hidden_states" / "ds" / "000.safetensors")
    (root / "ds" / "tokens" / "000.json").write_text(json.dumps({"rows": 1000}))


def test_whole_files_pass_and_each_kind_of_damage_is_named(tmp_path):
    root = tmp_path / "results"
    _tree(root)
    assert damaged.scan(root) == []
    whole = (root / "ds" / "tokens" / "000.parquet").read_bytes()
    cases = {
        "000.parquet": (whole[: len(whole) // 2], "cut off: no parquet footer at its end"),
        "001.parquet": (b"", "0 bytes"),
        "002.parquet": (b"<html>" + whole[6:], "not a parquet file (no PAR1 at its start)"),
        "003.parquet": (b"PAR1" + b"\0" * 4 + (10**6).to_bytes(4, "little") + b"PAR1", "cut off: its footer says"),
        "001.json": (b'{"rows": 10', "not JSON (Expecting"),
    }
    for name, (data, _) in cases.items():
        (root / "ds" / "tokens" / name).write_bytes(data)
    st = (root / "hidden_states" / "ds" / "000.safetensors").read_bytes()
    (root / "hidden_states" / "ds" / "000.safetensors").write_bytes(st[:-100])
    (root / "hidden_states" / "ds" / "001.safetensors").write_bytes(st[:20])
    (root / "ds" / "tokens" / ".000.parquet.ab12.tmp").write_bytes(b"")  # a writer's temporary: not an output
    (root / "export" / "speculators" / "hs_0.safetensors").write_bytes(b"")  # exports: not looked at
    (root / "reports").mkdir()
    (root / "reports" / "plan.json").write_text("{")
    found = {p.name: why for p, why in damaged.scan(root)}
    assert set(found) == {*cases, "000.safetensors", "001.safetensors"}
    for name, (_, why) in cases.items():
        assert found[name].startswith(why), (name, found[name])
    n = 8 + int.from_bytes(st[:8], "little")
    assert found["000.safetensors"] == f"cut off: its tensors end at byte {len(st):,}, the file has {len(st) - 100:,}"
    assert found["001.safetensors"] == f"cut off: its header says {n - 8:,} bytes, the file has 20"


def test_a_dry_run_names_them_and_a_run_removes_them(tmp_path):
    root = tmp_path / "results"
    _tree(root)
    bad = root / "ds" / "tokens" / "000.parquet"
    bad.write_bytes(bad.read_bytes()[:100])
    assert damaged.remove_damaged(root, dry_run=True) == [
        f"{bad} is damaged (cut off: no parquet footer at its end): a run (not -n) removes it and rebuilds it"
    ]
    assert bad.exists()
    assert damaged.remove_damaged(root) == [
        f"{bad} is damaged (cut off: no parquet footer at its end): removed; this run rebuilds it (replies come "
        "from the journal: nothing paid for is bought again)"
    ]
    assert not bad.exists() and (root / "ds" / "tokens" / "000.json").exists()
    assert damaged.remove_damaged(root) == [] and damaged.remove_damaged(tmp_path / "absent") == []
