"""The in-place layouts on the demo build (speculators_inplace, specforge_inplace, modelopt_inplace): the data
directory, the ref manifest and the side tables are written from the merge alone (no states copied, no extract job
run), and speculators' own ArrowDataset, SpecForge's own feature loader and Model-Optimizer's own streaming dataset
read each shard's samples (through this package's backend, store and _fetch) as soon as that shard's extract job
ends, while a later one still extracts."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from eagle3_data.testing.workflow import run_snakemake, snakemake_env

torch = pytest.importorskip("torch")
pytest.importorskip("speculators")
pytest.importorskip("specforge")
pytest.importorskip("modelopt.torch.speculative.plugins.hf_streaming_dataset", exc_type=ImportError)


def test_a_trainer_reads_the_first_finished_shard_while_a_later_one_still_extracts(demo_run, tmp_path):
    from speculators.train.data import ArrowDataset
    from speculators.train.recovery import SampleUnavailable

    from specforge.runtime.data_plane.disagg_ingest import read_ref_manifest
    from specforge.runtime.data_plane.feature_dataloader import FeatureDataLoader

    from eagle3_data.export.inplace import InPlaceTransfer
    from eagle3_data.export.inplace_modelopt import InPlaceStreamingDataset
    from eagle3_data.export.inplace_specforge import InPlaceFeatureStore

    wd = tmp_path / "wf"
    shutil.copytree(demo_run, wd, symlinks=True)
    (wd / "inplace.yaml").write_text("export:\n  layouts: [speculators_inplace, specforge_inplace, modelopt_inplace]\n")
    args = ("--configfile", "config.yaml", "inplace.yaml")
    for p in (wd / "results/hidden_states").glob("*/*.safetensors"):
        p.unlink()  # as before extraction: no states at all
    out = wd / "results/export/speculators_inplace"
    target = "results/export/speculators_inplace/data-00000-of-00001.arrow"
    refs_path = wd / "results/export/specforge_inplace/manifest.json"
    streamed = [f"results/export/modelopt_inplace/{k:03d}.json" for k in range(2)]  # (the demo's 2 merged shards)
    proc = run_snakemake(wd, target, str(refs_path.relative_to(wd)), *streamed, "--cores", "2", *args)  # targets first
    assert "extract" not in (proc.stdout + proc.stderr).split("Job stats:")[1].split("Reasons")[0]
    assert not list((wd / "results/hidden_states").glob("*/*.safetensors")) and not (out / "hidden_states").exists()
    manifest = json.loads((out / "000.json").read_text())
    assert manifest["num_written"] == 0 and manifest["bytes"] > 0

    side = [r for p in sorted(out.glob("samples_*.parquet")) for r in pq.read_table(p).to_pylist()]
    assert [r["index"] for r in side] == list(range(len(side)))
    by_source: dict[str, list[int]] = {}
    for r in side:
        by_source.setdefault(r["source"], []).append(r["index"])
    first, second = sorted(by_source, key=lambda s: -len(by_source[s]))[:2]
    ds = ArrowDataset(
        max_len=4096,
        datapath=str(out),
        transfer=InPlaceTransfer(out, recheck_s=0.0),
        on_missing="skip",
        hidden_states_dtype=torch.float32,
    )
    assert all(isinstance(ds[i], SampleUnavailable) for i in range(len(ds)))  # nothing extracted: all skipped
    refs = read_ref_manifest(str(refs_path))  # SpecForge's: the same samples in the same order
    assert [r.metadata["sample"] for r in refs] == [r["sample_id"] for r in side]
    store = InPlaceFeatureStore(refs_path.parent, recheck_s=0.0)

    def specforge_reads(i):
        (batch,) = FeatureDataLoader(store, refs=[refs[i]], gc_interval_s=None)
        return batch.tensors["input_ids"][0].tolist() == side[i]["input_ids"]

    stream = InPlaceStreamingDataset.from_data_path(wd / "results/export/modelopt_inplace", recheck_s=0.0)
    with pytest.raises(RuntimeError, match="no fetchable sample found in the entire corpus"):  # nothing extracted
        stream[0]

    # the first shard's extract job ends: its samples are served to the dataset already built
    run_snakemake(wd, f"results/hidden_states/{first}.safetensors", "--cores", "2", *args)
    item = ds[by_source[first][0]]
    assert not isinstance(item, SampleUnavailable) and item["hidden_states"].shape[0] == len(item["input_ids"])
    assert specforge_reads(by_source[first][0])
    assert stream[by_source[first][0]]["input_ids"].tolist() == side[by_source[first][0]]["input_ids"]
    # a later shard extracts while the trainer reads the first one's samples
    target = f"results/hidden_states/{second}.safetensors"
    later = subprocess.Popen(
        [sys.executable, "-m", "snakemake", target, "--cores", "1", "--nolock", *args],
        cwd=wd,
        env=snakemake_env(None, ()),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        read_during = [ds[i] for i in by_source[first]]
        assert later.poll() is None  # (snakemake takes seconds to start)
        assert isinstance(ds[by_source[second][0]], SampleUnavailable)
        with pytest.raises(KeyError, match="not extracted yet"):
            specforge_reads(by_source[second][0])
        # Model-Optimizer: a miss, answered with a later sample that has its states
        got = stream[by_source[second][0]]["input_ids"].tolist()
        assert got != side[by_source[second][0]]["input_ids"] and got in [
            side[i]["input_ids"] for i in by_source[first]
        ]
        assert not any(isinstance(x, SampleUnavailable) for x in read_during)
    finally:
        assert later.wait(timeout=900) == 0
    # done: the same dataset serves its samples now, and the sample ids are the side table's
    for i in by_source[second]:
        x = ds[i]
        assert not isinstance(x, SampleUnavailable) and x["input_ids"].tolist() == side[i]["input_ids"]
        assert specforge_reads(i)
        assert stream[i]["input_ids"].tolist() == side[i]["input_ids"]
