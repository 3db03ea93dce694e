"""Export to SpecForge / speculators layouts, read back as those projects read them; storage savers' error."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pyarrow as pa
import pytest
import torch

from eagle3_data.testing.workflow import save_tiny_llama
from eagle3_data import export as exp
from eagle3_data import extract as ex
from eagle3_data import schemas
from eagle3_data.settings import ExportSettings, ExtractSettings
from eagle3_data.extract.transformers_backend import load_target

H, L, V = 32, 8, 300
LAYERS = [1, 3, 4]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return save_tiny_llama(
        tmp_path_factory.mktemp("tiny") / "tiny-llama", hidden_size=H, num_layers=L, vocab_size=V, seed=1
    )


@pytest.fixture(scope="module")
def loaded(tiny_model):
    return load_target(tiny_model, dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def merged(tmp_path_factory):
    rng = random.Random(4)
    rows = []
    for i in range(9):
        n = rng.choice([5, 12, 33, 60])
        p = rng.randint(1, n - 2)
        q = rng.randint(p + 1, n)  # supervised span [p, q): not always to the end
        rows.append(
            {
                "sample_id": f"x{i}",
                "dataset": "d",
                "input_ids": [rng.randrange(V) for _ in range(n)],
                "loss_mask": [0] * p + [1] * (q - p) + [0] * (n - q),
                "num_tokens": n,
                "num_supervised": q - p,
                "truncated": False,
                "source": f"d/{i % 2:03d}",
            }
        )
    path = tmp_path_factory.mktemp("merged") / "000.parquet"
    schemas.write_checked(schemas.from_rows(rows, schemas.MERGED), "merged", path)
    return path, rows


def extract_selections(tmp_path, rows, model=None, **kw) -> tuple:
    """The extract stage's files for ``rows``: one selection per ``source`` (rows in another order than the
    merged shard, as merge writes them), extracted into ``<tmp>/states/<source>.safetensors``; returns the
    states dir and the selections mapping a merge manifest would hold."""
    states, selections = tmp_path / "states", {}
    for src in sorted({r["source"] for r in rows}):
        part = sorted((r for r in rows if r["source"] == src), key=lambda r: r["sample_id"], reverse=True)
        sel = tmp_path / "selection" / f"{src}.parquet"
        schemas.write_checked(schemas.from_rows(part, schemas.MERGED), "merged", sel)
        ex.extract_states(
            sel,
            states / f"{src}.safetensors",
            selection_digest=f"digest-{src}",
            model=model,
            settings=ExtractSettings.defaults(**{"dtype": "float32", **kw}),
        )
        selections[src] = {"digest": f"digest-{src}"}
    return states, {"shards": [{"samples": len(rows)}], "selections": selections}


# --- the readers, as the projects document them ----------------------------------------------------------


def specforge_list_local_files(path, suffixes=(".ckpt", ".ckpt.gz")):
    """SpecForge specforge/data/preprocessing.py::list_local_files (walks recursively, sorted)."""
    out = []
    for root, _dirs, files in os.walk(path):
        out += [os.path.join(root, f) for f in files if any(f.endswith(s) for s in suffixes)]
    return sorted(out)


def specforge_process_data(path, max_len):
    """SpecForge OfflineEagle3Dataset: torch.load, squeeze(0), cut to max_len, loss_mask[-1] = 0."""
    data = torch.load(path, weights_only=False, mmap=True)
    hidden_state = data["aux_hidden_state"].squeeze(0)[:max_len][None, :]
    target = data["hidden_state"].squeeze(0)[:max_len][None, :]
    input_ids = data["input_ids"][:max_len][None, :]
    loss_mask = data["loss_mask"][:max_len][None, :].clone()
    loss_mask[0, -1] = 0
    return {"hidden_state": hidden_state, "target": target, "input_ids": input_ids, "loss_mask": loss_mask}


def speculators_get_raw(out_dir, index, arrow_row):
    """speculators ArrowDataset._get_raw_data with FileTransfer(<datapath>/hidden_states)."""
    from safetensors.torch import load_file

    loaded_hs = load_file(os.path.join(out_dir, "hidden_states", f"hs_{index}.safetensors"))
    assert torch.equal(loaded_hs["token_ids"], torch.tensor(arrow_row["input_ids"]))
    return {
        "hidden_states": loaded_hs["hidden_states"][:, :-1].flatten(1),
        "input_ids": loaded_hs["token_ids"],
        "verifier_last_hidden_states": loaded_hs["hidden_states"][:, -1],
        "loss_mask": torch.tensor(arrow_row["loss_mask"]),
    }


def hf_states(model, ids):
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states


# --- tests -------------------------------------------------------------------------------------------------


def test_specforge_layout_reads_back(tmp_path, tiny_model, loaded, merged):
    path, rows = merged
    states, man = extract_selections(
        tmp_path, rows, model_path=tiny_model, layers=LAYERS, batch_tokens=128, model=loaded
    )
    out = tmp_path / "specforge"
    got = exp.export(
        exp.MergedShard(path, start_index=1998),
        out,
        layout="specforge",
        states_dir=states,
        merge_manifest=man,
        settings=ExportSettings.defaults(group_size=2000),
        manifest_path=tmp_path / "m.json",
    )
    assert json.loads((tmp_path / "m.json").read_text())["end_index"] == 1998 + len(rows)
    files = specforge_list_local_files(out)
    assert len(files) == len(rows) == got["num_samples"]
    assert (out / "rows_0-2000" / "data_1999.ckpt").exists() and (out / "rows_2000-4000" / "data_2000.ckpt").exists()
    model, _ = loaded
    for j, r in enumerate(rows):  # the merged shard's order, whatever order the selections hold the samples in
        f = exp.specforge_path(out, 1998 + j, 2000)
        raw = torch.load(f, weights_only=True)
        assert set(raw) == {"input_ids", "loss_mask", "aux_hidden_state", "hidden_state"}
        T = len(r["input_ids"])
        assert raw["input_ids"].dtype == torch.int64 and raw["input_ids"].shape == (T,)
        assert raw["loss_mask"].dtype == torch.int64 and raw["loss_mask"].tolist() == r["loss_mask"]
        assert raw["aux_hidden_state"].shape == (1, T, 3 * H) and raw["hidden_state"].shape == (1, T, H)
        d = specforge_process_data(f, max_len=4096)
        assert d["input_ids"][0].tolist() == r["input_ids"]
        with ex.StatesFile(states / f"{r['source']}.safetensors") as sf:
            stored = sf.sample(sf.index[r["sample_id"]], final="post")
        assert torch.equal(d["hidden_state"][0], stored["aux_hidden_states"])
        assert torch.equal(d["target"][0], stored["hidden_states"])
        ref = hf_states(model, r["input_ids"])
        torch.testing.assert_close(d["hidden_state"][0, :, H : 2 * H], ref[LAYERS[1] + 1][0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(d["target"][0], ref[-1][0], atol=1e-5, rtol=1e-5)  # post-norm
    # rerun overwrites in place, byte for byte, and leaves no temporary files
    before = {f: open(f, "rb").read() for f in files}
    exp.export(
        exp.MergedShard(path, start_index=1998),
        out,
        layout="specforge",
        states_dir=states,
        settings=ExportSettings.defaults(),
    )
    assert {f: open(f, "rb").read() for f in specforge_list_local_files(out)} == before
    assert not [p for p in out.rglob(".*")]
    # the same states (final_norm both, the default) serve speculators too: its pre-norm final state
    spec = exp.export(
        path,
        tmp_path / "spec",
        layout="speculators",
        states_dir=states,
        merge_manifest=man,
        settings=ExportSettings.defaults(),
    )
    assert (spec["final_norm"], spec["final_state"], spec["num_written"]) == ("both", "pre", len(rows))
    # states computed for another selection (the merge's digest moved on) are refused by name
    stale = dict(man, selections={k: {"digest": "newer"} for k in man["selections"]})
    with pytest.raises(ValueError, match="another selection"):
        exp.export(
            path,
            tmp_path / "stale",
            layout="specforge",
            states_dir=states,
            merge_manifest=stale,
            settings=ExportSettings.defaults(),
        )


def test_speculators_layout_reads_back(tmp_path, tiny_model, loaded, merged):
    import pyarrow.parquet as pq

    path, rows = merged
    states, man = extract_selections(
        tmp_path, rows, model_path=tiny_model, layers=LAYERS, model=loaded, final_norm="pre"
    )
    out = tmp_path / "speculators"
    # the merged set's provenance (rule provenance): the side table takes each sample's columns from it
    from eagle3_data.provenance import PROVENANCE, SIDE_COLUMNS

    prov = tmp_path / "provenance.parquet"
    prov_rows = [
        {
            "set": "train",
            "merged_file": str(path),
            "row": j,
            "index": 5 + j,
            "sample_id": r["sample_id"],
            "dataset": "d",
            "source_path": "src.jsonl",
            "source_row": 100 + j,
            "request_key": f"key{j}",
            "backend": "b",
            "cost_usd": 0.01 * j,
            "attempts": 1 + j % 2,
        }
        for j, r in enumerate(rows)
    ]
    prov_rows.append({**prov_rows[0], "set": "heldout", "index": 0, "sample_id": "other"})  # another set: ignored
    pq.write_table(pa.Table.from_pylist(prov_rows, schema=PROVENANCE), prov)
    got = exp.export(
        exp.MergedShard(path, start_index=5),
        out,
        layout="speculators",
        states_dir=states,
        merge_manifest=man,
        settings=ExportSettings.defaults(),
        provenance=prov,
    )
    assert got["final_norm"] == "pre"
    arrow = pq.read_table(out / "samples_000000005.parquet").to_pylist()
    assert [a["index"] for a in arrow] == list(range(5, 5 + len(rows)))
    assert [a["sample_id"] for a in arrow] == [r["sample_id"] for r in rows]
    assert set(SIDE_COLUMNS) <= set(arrow[0])
    assert [(a["source_row"], a["request_key"], a["attempts"]) for a in arrow] == [
        (100 + j, f"key{j}", 1 + j % 2) for j in range(len(rows))
    ]
    with pytest.raises(ValueError, match="does not describe the rows"):  # a provenance table of another merge
        exp.export(
            exp.MergedShard(path, start_index=4),
            tmp_path / "spec2",
            layout="speculators",
            states_dir=states,
            merge_manifest=man,
            settings=ExportSettings.defaults(),
            provenance=prov,
        )
    model, decoder = loaded
    for j, r in enumerate(rows):
        d = speculators_get_raw(out, 5 + j, arrow[j])
        T = len(r["input_ids"])
        assert d["hidden_states"].shape == (T, 3 * H) and d["verifier_last_hidden_states"].shape == (T, H)
        assert d["loss_mask"].tolist() == r["loss_mask"] and arrow[j]["seq_len"] == T
        ref = hf_states(model, r["input_ids"])
        for k, layer in enumerate(LAYERS):
            torch.testing.assert_close(
                d["hidden_states"][:, k * H : (k + 1) * H], ref[layer + 1][0], atol=1e-5, rtol=1e-5
            )
        pre = d["verifier_last_hidden_states"]
        # pre-norm: the trainer's verifier_norm gives back HF's (post-norm) last hidden state
        with torch.inference_mode():
            torch.testing.assert_close(decoder.norm(pre), ref[-1][0], atol=1e-5, rtol=1e-5)
        assert (pre - ref[-1][0]).abs().max() > 1e-2
    # states of one form only (final_norm: pre) cannot serve a post-norm layout: refused, naming the setting
    with pytest.raises(
        ValueError, match="holds pre-norm final states, not post-norm; extract with extract.final_norm: both"
    ):
        exp.export(path, tmp_path / "sf", layout="specforge", states_dir=states, settings=ExportSettings.defaults())
    with pytest.raises(ValueError, match="add dflash to extract.drafters"):
        exp.export(
            path, tmp_path / "df", layout="specforge_dflash", states_dir=states, settings=ExportSettings.defaults()
        )


def error_stats(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    a, b = a.float(), b.float()
    cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
    return (a - b).abs().max().item(), cos.min().item()


def test_storage_savers_error_and_size(tmp_path, tiny_model, merged):
    path, rows = merged
    model16 = load_target(tiny_model, dtype="bfloat16", device="cpu")
    base, saved = tmp_path / "bf16.safetensors", tmp_path / "saved" / "d" / "all.safetensors"
    ib = ex.extract_states(
        path,
        base,
        settings=ExtractSettings.defaults(model_path=tiny_model, layers=LAYERS, dtype="bfloat16"),
        model=model16,
    )
    isv = ex.extract_states(
        path,
        saved,
        settings=ExtractSettings.defaults(
            model_path=tiny_model, layers=LAYERS, dtype="bfloat16", final_states="supervised", aux_format="fp8_e4m3"
        ),
        model=model16,
    )
    tb, _ = ex.load_states(base)
    ts, meta = ex.load_states(saved)
    assert meta["aux_format"] == "fp8_e4m3" and meta["final_states"] == "supervised"
    assert torch.equal(tb["input_ids"], ts["input_ids"]) and torch.equal(tb["loss_mask"], ts["loss_mask"])

    # final states: exact where stored; stored exactly where mask[p] or mask[p-1] inside a sample
    fm = ts["final_mask"]
    for j, r in enumerate(rows):
        s, e = tb["sample_offsets"][j].item(), tb["sample_offsets"][j + 1].item()
        m = r["loss_mask"]
        want = [bool(m[p] or (p > 0 and m[p - 1])) for p in range(len(m))]
        assert fm[s:e].tolist() == want
    assert torch.equal(ts["hidden_states"][fm], tb["hidden_states"][fm])
    assert (ts["hidden_states"][~fm] == 0).all()
    assert isv["final_rows"] == int(fm.sum()) < ib["final_rows"] == ib["num_tokens"]

    # fp8 e4m3 with per-token scales: 3 mantissa bits -> relative error <= 2^-4 of each row's amax
    raw, _ = ex.read_hidden_states(saved)
    assert raw["aux_hidden_states"].dtype == torch.float8_e4m3fn and raw["aux_scales"].shape == (ib["num_tokens"], 3)
    ref = tb["aux_hidden_states"].float().reshape(-1, 3, H)
    got = ts["aux_hidden_states"].float().reshape(-1, 3, H)
    amax = ref.abs().amax(-1, keepdim=True)
    assert ((got - ref).abs() <= amax * 2**-4 + 1e-6).all()
    max_abs, min_cos = error_stats(got.reshape(-1, H), ref.reshape(-1, H))
    assert min_cos > 0.99 and 0 < max_abs
    # and it is smaller on disk: 3H fp8 + scales vs 3H bf16
    assert isv["bytes"] < 0.7 * ib["bytes"]

    # the quantiser round-trips exactly representable values
    x = torch.tensor([[1.0, -2.0, 0.5, 448.0], [0.0, 0.0, 0.0, 0.0]])
    q, sc = ex.quantize_fp8(x, 1)
    torch.testing.assert_close(ex.dequantize_fp8(q, sc), x)

    # export from the saved file: SpecForge reads full-size tensors, zeros where not stored
    out = tmp_path / "sf"
    one = tmp_path / "one.parquet"  # a merged shard whose rows all come from selection "d/all"
    schemas.write_checked(schemas.from_rows([dict(r, source="d/all") for r in rows], schemas.MERGED), "merged", one)
    exp.export(one, out, layout="specforge", states_dir=tmp_path / "saved", settings=ExportSettings.defaults())
    d = specforge_process_data(exp.specforge_path(out, 0, 2000), 4096)
    T0 = len(rows[0]["input_ids"])
    assert d["hidden_state"].shape == (1, T0, 3 * H) and d["target"].shape == (1, T0, H)
    assert d["hidden_state"].dtype == torch.bfloat16


def test_start_indices(tmp_path):
    man = {"shards": [{"samples": 3}, {"samples": 0}, {"samples": 5}]}
    assert exp.start_indices(man) == [0, 3, 3]
    p = tmp_path / "m.json"
    p.write_text(json.dumps(man))
    assert exp.start_indices(p) == [0, 3, 3]
    with pytest.raises(ValueError, match="layout"):
        exp.export(p, tmp_path, layout="eagle", states_dir=tmp_path, settings=ExportSettings.defaults())


def test_a_later_export_removes_what_the_earlier_one_left(tmp_path, tiny_model, loaded, merged):
    """Trainers read every file in the export folder: after the merged set shrinks, a shard's start moves or
    `group_size` changes, the files the new export does not write are removed (each shard's job removes its own
    indices' files; the last shard's job everything past the end), and nothing it writes."""
    import pyarrow.parquet as pq

    path, rows = merged
    n = len(rows)
    states, man = extract_selections(tmp_path, rows, model_path=tiny_model, layers=LAYERS, model=loaded)
    out = tmp_path / "sf"
    two = dict(man, shards=[{"samples": 2}, {"samples": n}])  # this shard second, after 2 samples
    exp.export(
        exp.MergedShard(path, start_index=2),
        out,
        layout="specforge",
        states_dir=states,
        merge_manifest=two,
        settings=ExportSettings.defaults(group_size=4),
    )
    assert len(specforge_list_local_files(out)) == n
    # the set shrinks by the 2 samples before it: this shard starts at 0 now, with 4 per folder -> rows_*/ of 3
    # and the old indices n, n+1 past the new end
    got = exp.export(
        exp.MergedShard(path, start_index=0),
        out,
        layout="specforge",
        states_dir=states,
        merge_manifest=man,
        settings=ExportSettings.defaults(group_size=3),
    )
    files = specforge_list_local_files(out)
    assert files == sorted(str(exp.specforge_path(out, i, 3)) for i in range(n))
    assert got["removed_stale"] == n  # every old file: moved folders or past the end
    for i in range(n):  # and what is there is the new export's sample i
        got_ids = torch.load(exp.specforge_path(out, i, 3), weights_only=True)["input_ids"].tolist()
        assert got_ids == rows[i]["input_ids"]
    # a shard that is not the last removes only its own indices' files: a file past its range stays
    stray = exp.specforge_path(out, n + 5, 3)
    stray.parent.mkdir(parents=True, exist_ok=True)
    stray.write_bytes(b"x")
    first = dict(man, shards=[{"samples": n}, {"samples": 10}])
    assert (
        exp.export(
            exp.MergedShard(path, start_index=0),
            out,
            layout="specforge",
            states_dir=states,
            merge_manifest=first,
            settings=ExportSettings.defaults(group_size=3),
        )["removed_stale"]
        == 0
    )
    assert stray.exists()
    # at its own path in a shard's range it is that shard's to overwrite; past the end, the last shard removes it
    assert exp.prune_stale(out, "specforge", start=n, end=n + 10, total=n + 10, group_size=3) == []
    assert exp.prune_stale(out, "specforge", start=n, end=n + 2, total=n + 2, group_size=3) == [str(stray)]

    # speculators: a moved start leaves a samples_{old start}.parquet whose indices point at other samples now,
    # and hs_{i} past the end
    states, man = extract_selections(
        tmp_path / "pre", rows, model_path=tiny_model, layers=LAYERS, model=loaded, final_norm="pre"
    )
    out = tmp_path / "spec"
    exp.export(
        exp.MergedShard(path, start_index=2),
        out,
        layout="speculators",
        states_dir=states,
        merge_manifest=two,
        settings=ExportSettings.defaults(),
    )
    assert (out / "samples_000000002.parquet").exists()
    got = exp.export(
        exp.MergedShard(path, start_index=0),
        out,
        layout="speculators",
        states_dir=states,
        merge_manifest=man,
        settings=ExportSettings.defaults(),
    )
    assert sorted(p.name for p in out.glob("samples_*.parquet")) == ["samples_000000000.parquet"]
    assert sorted(int(p.stem[3:]) for p in (out / "hidden_states").glob("hs_*.safetensors")) == list(range(n))
    assert got["removed_stale"] == 1 + 2  # the old samples file, hs_n and hs_{n+1}
    assert pq.read_table(out / "samples_000000000.parquet").column("index").to_pylist() == list(range(n))
    # an empty shard writes no samples file: it would share its start with the next shard's
    empty = tmp_path / "empty.parquet"
    schemas.write_checked(schemas.from_rows([], schemas.MERGED), "merged", empty)
    exp.export(
        exp.MergedShard(empty, start_index=0),
        out,
        layout="speculators",
        states_dir=states,
        merge_manifest=dict(man, shards=[{"samples": 0}, {"samples": n}]),
        settings=ExportSettings.defaults(),
    )
    assert pq.read_table(out / "samples_000000000.parquet").num_rows == n


def test_heldout_set_exports_beside_the_training_set(tmp_path, tiny_model, loaded, merged):
    """merge.heldout: the held-out file exports into its own directory (rule export_heldout:
    results/export/heldout/<layout>/), indices from 0 in its shuffled order, read from the same states files; a
    trainer reading the training directory finds none of it, and each set's pruning leaves the other alone."""
    import pyarrow.parquet as pq

    path, rows = merged
    train_rows, held_rows = rows[:6], rows[6:]
    root = tmp_path / "export"
    train_p, held_p = tmp_path / "000.parquet", tmp_path / "heldout.parquet"
    schemas.write_checked(schemas.from_rows(train_rows, schemas.MERGED), "merged", train_p)
    schemas.write_checked(schemas.from_rows(held_rows, schemas.MERGED), "merged", held_p)
    for layout, norm in (("specforge", "post"), ("speculators", "pre")):
        states, man = extract_selections(
            tmp_path / norm, rows, model_path=tiny_model, layers=LAYERS, model=loaded, final_norm=norm
        )  # one selection file per source: both sets' rows
        man = dict(man, shards=[{"samples": len(train_rows)}], heldout={"samples": len(held_rows)})
        train_dir, held_dir = root / layout, root / "heldout" / layout
        # what an earlier, larger held-out export left past the end; and a training file at index 7
        stale_held = (
            exp.specforge_path(held_dir, 7, 2000) if layout == "specforge" else exp.speculators_path(held_dir, 7)
        )
        stale_train = (
            exp.specforge_path(train_dir, 7, 2000) if layout == "specforge" else exp.speculators_path(train_dir, 7)
        )
        for p in (stale_held, stale_train):
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(b"old")
        got = exp.export(
            exp.MergedShard(held_p, heldout=True),
            held_dir,
            layout=layout,
            states_dir=states,
            merge_manifest=man,
            settings=ExportSettings.defaults(),
            manifest_path=root / "heldout" / f"{layout}.json",
        )
        assert (got["set"], got["start_index"], got["end_index"], got["removed_stale"]) == ("heldout", 0, 3, 1)
        assert not stale_held.exists() and stale_train.exists()  # its own set only
        exp.export(
            train_p, train_dir, layout=layout, states_dir=states, merge_manifest=man, settings=ExportSettings.defaults()
        )
        assert not stale_train.exists()  # past the training set's end (6): the training export's to remove
        if layout == "specforge":
            train_files, held_files = specforge_list_local_files(train_dir), specforge_list_local_files(held_dir)
            assert held_files == [str(exp.specforge_path(held_dir, i, 2000)) for i in range(3)]
            assert len(train_files) == 6 and all(Path(f).parent.parent == train_dir for f in train_files)
            ids = [torch.load(f, weights_only=True)["input_ids"].tolist() for f in held_files]
            assert ids == [r["input_ids"] for r in held_rows]  # the held-out file's order
            train_ids = [torch.load(f, weights_only=True)["input_ids"].tolist() for f in train_files]
            assert sorted(train_ids) == sorted(r["input_ids"] for r in train_rows)
        else:
            arrow = pq.read_table(held_dir / "samples_000000000.parquet").to_pylist()
            assert [a["index"] for a in arrow] == [0, 1, 2]
            assert [a["sample_id"] for a in arrow] == [r["sample_id"] for r in held_rows]
            for j, r in enumerate(held_rows):
                d = speculators_get_raw(held_dir, j, arrow[j])
                assert d["loss_mask"].tolist() == r["loss_mask"]
            assert sorted(p.name for p in (held_dir / "hidden_states").iterdir()) == [
                f"hs_{i}.safetensors" for i in range(3)
            ]
            assert len(list((train_dir / "hidden_states").iterdir())) == 6
        assert json.loads((root / "heldout" / f"{layout}.json").read_text())["num_samples"] == 3


def test_one_capture_exports_every_contract(tmp_path, tiny_model, loaded, merged):
    """drafters eagle3 + dflash + dspark, final_norm both: one extraction, six layouts, each sample's tensors
    equal to HF's (DFlash/DSpark layers, post- or pre-norm final); a sample SpecForge's DFlash family would refuse
    (no two consecutive supervised tokens) is skipped, counted and named, and an earlier export's file at its
    index removed."""
    import pyarrow.parquet as pq
    from safetensors.torch import load_file

    path, rows = merged
    odd = {
        "sample_id": "y0",
        "dataset": "d",
        "input_ids": list(range(10, 20)),
        "loss_mask": [0, 1] * 5,
        "num_tokens": 10,
        "num_supervised": 5,
        "truncated": False,
        "source": "d/000",
    }
    rows = rows[:4] + [odd] + rows[4:]
    one = tmp_path / "000.parquet"
    schemas.write_checked(schemas.from_rows(rows, schemas.MERGED), "merged", one)
    states, man = extract_selections(
        tmp_path, rows, model_path=tiny_model, layers=LAYERS, model=loaded, drafters=["eagle3", "dflash", "dspark"]
    )
    dfl = ex.dflash_layer_ids(L)
    assert dfl == [1, 2, 3, 4, 5]
    model, decoder = loaded
    got = {}
    stale = exp.specforge_path(tmp_path / "specforge_dflash", 4, 2000)  # an earlier export's file of "y0"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"old")
    for layout in exp.LAYOUTS:
        got[layout] = exp.export(
            one,
            tmp_path / layout,
            layout=layout,
            states_dir=states,
            merge_manifest=man,
            settings=ExportSettings.defaults(),
        )
    lone = [r["sample_id"] for r in rows if not any(a and b for a, b in zip(r["loss_mask"], r["loss_mask"][1:]))]
    assert "y0" in lone and len(lone) < len(rows)
    for layout in ("specforge_dflash", "specforge_dspark"):
        assert got[layout]["skipped"] == {"no_consecutive_supervised_tokens": lone}
        assert got[layout]["num_written"] == len(rows) - len(lone) and got[layout]["num_samples"] == len(rows)
        assert not exp.specforge_path(tmp_path / layout, 4, 2000).exists()
    assert got["specforge_dflash"]["removed_stale"] == 1 and not stale.exists()
    assert all(
        got[k]["num_written"] == len(rows) and not got[k]["skipped"]
        for k in ("specforge", "speculators", "speculators_fp8", "modelopt")
    )
    for j, r in enumerate(rows):
        ref = hf_states(model, r["input_ids"])
        T = len(r["input_ids"])
        if r["sample_id"] not in lone:
            d = torch.load(exp.specforge_path(tmp_path / "specforge_dspark", j, 2000), weights_only=True)
            assert set(d) == {"input_ids", "loss_mask", "hidden_states", "target_last_hidden_states"}
            assert d["hidden_states"].shape == (1, T, 5 * H) and d["loss_mask"].tolist() == r["loss_mask"]
            want = torch.cat([ref[x + 1][0] for x in dfl], dim=-1)  # SpecForge: hidden_states[layer_id + 1]
            torch.testing.assert_close(d["hidden_states"][0], want, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(d["target_last_hidden_states"][0], ref[-1][0], atol=1e-5, rtol=1e-5)
            f = torch.load(exp.specforge_path(tmp_path / "specforge_dflash", j, 2000), weights_only=True)
            assert set(f) == {"input_ids", "loss_mask", "hidden_states"}
            assert torch.equal(f["hidden_states"], d["hidden_states"])
        m = torch.load(exp.modelopt_path(tmp_path / "modelopt", j, 2000), weights_only=True)
        assert set(m) == {"input_ids", "hidden_states", "aux_hidden_states", "loss_mask", "conversation_id"}
        assert m["conversation_id"] == r["sample_id"] and m["loss_mask"].dtype == torch.int64
        torch.testing.assert_close(m["hidden_states"], ref[-1][0], atol=1e-5, rtol=1e-5)  # post-norm: HF [-1]
        torch.testing.assert_close(
            m["aux_hidden_states"], torch.cat([ref[x + 1][0] for x in LAYERS], -1), atol=1e-5, rtol=1e-5
        )
        # speculators FP8: the bf16/fp32 file's [T, 4, H] quantised with one scale per token, as hs_connectors does
        full = load_file(exp.speculators_path(tmp_path / "speculators", j))
        fp8 = load_file(exp.speculators_path(tmp_path / "speculators_fp8", j))
        assert fp8["hidden_states"].dtype == torch.float8_e4m3fn and fp8["hidden_states"].shape == (T, 4, H)
        assert fp8["hidden_states_scales"].shape == (T, 1, 1) and torch.equal(fp8["token_ids"], full["token_ids"])
        x = full["hidden_states"].float()
        deq = fp8["hidden_states"].float() * fp8["hidden_states_scales"]
        amax = x.abs().amax(dim=(1, 2), keepdim=True)
        assert ((deq - x).abs() <= amax * 2**-4 + 1e-6).all()
        with torch.inference_mode():  # the pre-norm final state, as speculators reads it
            torch.testing.assert_close(decoder.norm(full["hidden_states"][:, -1]), ref[-1][0], atol=1e-5, rtol=1e-5)
    # half the bytes of the full-precision file (here float32: a quarter), and each data path's rows
    assert got["speculators_fp8"]["bytes"] < 0.3 * got["speculators"]["bytes"]
    for layout in ("speculators", "speculators_fp8"):
        assert pq.read_table(tmp_path / layout / "samples_000000000.parquet").num_rows == len(rows)
