"""Extraction on a tiny random Llama: stored states equal HF output_hidden_states, batched = one by one."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from safetensors import safe_open

from conftest import save_tiny_llama
from eagle3_data import schemas
from eagle3_data import extract as ex

H, L, V = 32, 6, 300


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-llama", hidden_size=H, num_layers=L,
                           vocab_size=V, seed=0)


@pytest.fixture(scope="module")
def loaded(tiny_model):
    return ex.load_target(tiny_model, dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def merged(tmp_path_factory):
    rng = random.Random(0)
    rows = []
    for i in range(13):
        n = rng.choice([3, 7, 20, 45, 64, 90])
        p = rng.randint(1, n - 1)
        rows.append({"sample_id": f"s{i}", "dataset": "d" if i % 2 else "e",
                     "input_ids": [rng.randrange(V) for _ in range(n)], "loss_mask": [0] * p + [1] * (n - p),
                     "num_tokens": n, "num_supervised": n - p, "truncated": False})
    path = tmp_path_factory.mktemp("merged") / "000.parquet"
    schemas.write_checked(schemas.from_rows(rows, schemas.MERGED), "merged", path)
    return path, rows


def reference_states(model, ids):
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    return out.hidden_states


def test_default_layers():
    assert ex.default_layers(32) == [1, 15, 28]
    assert ex.default_layers(61) == [1, 29, 57]  # SpecForge's DeepSeek-V3 config
    assert ex.default_layers(36) == [1, 17, 32]
    assert ex.default_layers(8) == [1, 3, 4]
    assert ex.default_layers(6) == [1, 2]
    assert ex.default_layers(1) == [0]
    with pytest.raises(ValueError, match="outside"):
        ex.resolve_layers([0, 6], 6)
    with pytest.raises(ValueError, match="repeat"):
        ex.resolve_layers([1, 1], 6)


def test_pack_batches_respects_budget():
    lengths = [5, 100, 7, 30, 31, 2, 99, 400]
    batches = ex.pack_batches(lengths, 128)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 128
    assert [7] in batches  # longer than the budget: alone


def test_states_match_hf_and_layout(tmp_path, tiny_model, loaded, merged):
    path, rows = merged
    out = tmp_path / "hs" / "000.safetensors"
    layers = [0, 2, 4]
    info = ex.extract(path, out, model_path=tiny_model, layers=layers, batch_tokens=256, model=loaded)
    T = sum(len(r["input_ids"]) for r in rows)
    assert info["num_tokens"] == T and info["num_samples"] == len(rows) and info["batches"] > 1
    with safe_open(str(out), framework="pt") as f:
        meta = f.metadata()
        t = {k: f.get_tensor(k) for k in f.keys()}
    assert t["input_ids"].dtype == torch.int32 and t["input_ids"].shape == (T,)
    assert t["loss_mask"].dtype == torch.int8 and t["loss_mask"].shape == (T,)
    assert t["aux_hidden_states"].shape == (T, 3 * H) and t["aux_hidden_states"].dtype == torch.float32
    assert t["hidden_states"].shape == (T, H)
    off = t["sample_offsets"]
    assert off.dtype == torch.int64
    assert off.tolist() == list(np.cumsum([0] + [len(r["input_ids"]) for r in rows]))
    assert json.loads(meta["layers"]) == layers
    assert json.loads(meta["sample_ids"]) == [r["sample_id"] for r in rows]
    assert meta["final_norm"] == "post" and "output of 0-based decoder layer" in meta["layer_convention"]
    assert (meta["num_tokens"], meta["num_samples"], meta["dtype"]) == (str(T), str(len(rows)), "float32")
    assert meta["model_path"] == str(tiny_model) and meta["num_layers"] == str(L)

    model, _ = loaded
    for n, r in enumerate(rows):
        s, e = off[n].item(), off[n + 1].item()
        assert t["input_ids"][s:e].tolist() == r["input_ids"]
        assert t["loss_mask"][s:e].tolist() == r["loss_mask"]
        hs = reference_states(model, r["input_ids"])
        for j, layer in enumerate(layers):
            got = t["aux_hidden_states"][s:e, j * H:(j + 1) * H]
            torch.testing.assert_close(got, hs[layer + 1][0], atol=1e-5, rtol=1e-5)
            # the other convention (input of layer i) is measurably different: the test can tell them apart
            assert (got - hs[layer][0]).abs().max() > 1e-2
        torch.testing.assert_close(t["hidden_states"][s:e], hs[-1][0], atol=1e-5, rtol=1e-5)
        assert (t["hidden_states"][s:e] - hs[-2][0]).abs().max() > 1e-2  # post-norm, not the last layer's raw output


def test_batched_equals_one_at_a_time_and_default_layers(tmp_path, tiny_model, loaded, merged):
    path, rows = merged
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    ia = ex.extract(path, a, model_path=tiny_model, batch_tokens=4096, model=loaded)
    ib = ex.extract(path, b, model_path=tiny_model, batch_tokens=1, model=loaded)
    assert ia["batches"] < ib["batches"] == len(rows)
    assert ia["layers"] == [1, 2]
    ta, ma = ex.read_hidden_states(a)
    tb, mb = ex.read_hidden_states(b)
    assert ta["aux_hidden_states"].shape == (ia["num_tokens"], 2 * H)
    for k in ta:
        torch.testing.assert_close(ta[k], tb[k], atol=1e-5, rtol=1e-5)
    assert ma == mb


def test_bf16_and_crash_leaves_no_file(tmp_path, tiny_model, merged, monkeypatch):
    path, rows = merged
    loaded16 = ex.load_target(tiny_model, dtype="bfloat16", device="cpu")
    out = tmp_path / "bf.safetensors"
    ex.extract(path, out, model_path=tiny_model, layers=[1, 2, 3], dtype="bfloat16", model=loaded16)
    t, meta = ex.read_hidden_states(out)
    assert t["aux_hidden_states"].dtype == torch.bfloat16 and meta["dtype"] == "bfloat16"
    assert torch.isfinite(t["aux_hidden_states"].float()).all()

    # a crash mid-shard: no output, no leftover temporary file
    calls = {"n": 0}
    real = ex._Capture._hook

    def flaky(self, key):
        fn = real(self, key)

        def wrapped(module, args, output):
            if key == "final":
                calls["n"] += 1
                if calls["n"] == 2:
                    raise RuntimeError("simulated crash")
            return fn(module, args, output)

        return wrapped

    monkeypatch.setattr(ex._Capture, "_hook", flaky)
    crash = tmp_path / "crash" / "000.safetensors"
    with pytest.raises(RuntimeError, match="simulated crash"):
        ex.extract(path, crash, model_path=tiny_model, batch_tokens=128, model=loaded16)
    assert not crash.exists()
    assert list(crash.parent.iterdir()) == []


def test_empty_shard_and_bad_ids(tmp_path, tiny_model, loaded):
    empty = tmp_path / "empty.parquet"
    schemas.write_checked(schemas.empty(schemas.MERGED), "merged", empty)
    out = tmp_path / "empty.safetensors"
    info = ex.extract(empty, out, model_path=tiny_model, model=loaded)
    t, meta = ex.read_hidden_states(out)
    assert info["num_tokens"] == 0 and t["aux_hidden_states"].shape == (0, 2 * H)
    assert t["sample_offsets"].tolist() == [0] and meta["num_samples"] == "0"

    bad = tmp_path / "bad.parquet"
    schemas.write_checked(schemas.from_rows([{"sample_id": "x", "dataset": "d", "input_ids": [1, V + 5],
                                              "loss_mask": [0, 1], "num_tokens": 2, "num_supervised": 1,
                                              "truncated": False}], schemas.MERGED), "merged", bad)
    with pytest.raises(ValueError, match="vocabulary"):
        ex.extract(bad, tmp_path / "bad.safetensors", model_path=tiny_model, model=loaded)
    assert not (tmp_path / "bad.safetensors").exists()
