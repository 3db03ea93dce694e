"""Extraction on a tiny random Llama: stored states equal HF output_hidden_states, batched = one by one, and a
rerun forwards only the samples whose states are not already stored (counted at the model's input)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors import safe_open

from eagle3_data.testing.workflow import save_tiny_llama
from eagle3_data import extract as ex
from eagle3_data import schemas
from eagle3_data.settings import ExtractSettings
from eagle3_data.extract import batching, transformers_backend as tb

H, L, V = 32, 6, 300


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return save_tiny_llama(
        tmp_path_factory.mktemp("tiny") / "tiny-llama", hidden_size=H, num_layers=L, vocab_size=V, seed=0
    )


@pytest.fixture(scope="module")
def loaded(tiny_model):
    return tb.load_target(tiny_model, dtype="float32", device="cpu")


def make_rows(n=13, seed=0, prefix="s"):
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        k = rng.choice([3, 7, 20, 45, 64, 90])
        p = rng.randint(1, k - 1)
        rows.append(
            {
                "sample_id": f"{prefix}{i}",
                "dataset": "d" if i % 2 else "e",
                "input_ids": [rng.randrange(V) for _ in range(k)],
                "loss_mask": [0] * p + [1] * (k - p),
                "num_tokens": k,
                "num_supervised": k - p,
                "truncated": False,
            }
        )
    return rows


def write_selection(path, rows):
    schemas.write_checked(schemas.from_rows(rows, schemas.MERGED), "merged", path)
    return path


@pytest.fixture(scope="module")
def merged(tmp_path_factory):
    rows = make_rows()
    return write_selection(tmp_path_factory.mktemp("merged") / "000.parquet", rows), rows


class TokenCounter:
    """Counts the real (unpadded) tokens that enter the decoder: what 'forwarded' means, measured at the model."""

    def __init__(self, decoder):
        self.tokens = 0
        self.handle = decoder.register_forward_pre_hook(self.hook, with_kwargs=True)

    def hook(self, module, args, kwargs):
        mask = kwargs.get("attention_mask")
        self.tokens += int(mask.sum()) if mask is not None else int(kwargs["input_ids"].numel())

    def remove(self):
        self.handle.remove()


def reference_states(model, ids):
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    return out.hidden_states


def test_default_layers_and_layer_checks():
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
    assert ex.resolve_layers([4, 1], 6) == [4, 1]  # order kept


def test_batch_plans_respect_budgets():
    lengths = [5, 100, 7, 30, 31, 2, 99, 400]
    padded = batching.padded_batches(lengths, 128)
    assert sorted(i for b in padded for i in b) == list(range(len(lengths)))
    for b in padded:
        assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 128
    assert [7] in padded  # longer than the budget: alone
    packed = batching.packed_batches(lengths, 128, max_samples=2)
    assert sorted(i for b in packed for i in b) == list(range(len(lengths)))
    assert all(len(b) <= 2 and (len(b) == 1 or sum(lengths[i] for i in b) <= 128) for b in packed)
    assert len(batching.packed_batches(lengths, 10_000)) == 1


def test_package_imports_no_torch_and_no_cycles():
    code = (
        "import sys, eagle3_data.extract, eagle3_data.plan, eagle3_data.export\n"
        "print(sorted(m for m in ('torch', 'transformers', 'sglang') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
    # the layering: layout/model/batching/vision import no backend and no stage; backends import no stage
    import ast
    from pathlib import Path

    pkg = Path(ex.__file__).parent
    imports = {}
    for f in pkg.glob("*.py"):
        tree = ast.parse(f.read_text())
        imports[f.stem] = {
            n.module.split(".")[0]
            for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom) and n.level == 1 and n.module
        }
    # norm: the final norm's formulas (torch only), read by the layout's readers
    assert imports["norm"] <= set() and imports["layout"] <= {"norm"} and imports["model"] <= set()
    assert imports["batching"] <= set() and imports["fused"] <= set()
    # vision: the image rows' inputs and the target's class, beside model (no backend, no stage)
    assert imports["vision"] <= set()
    assert imports["transformers_backend"] <= {"batching", "layout", "model", "fused", "vision"}
    assert imports["sglang_backend"] <= {"batching", "layout", "model"}
    assert "stage" not in set().union(*(v for k, v in imports.items() if k not in ("stage", "__init__")))


def test_states_match_hf_and_layout(tmp_path, tiny_model, loaded, merged):
    path, rows = merged
    out = tmp_path / "hs" / "000.safetensors"
    layers = [0, 2, 4]
    info = ex.extract_states(
        path,
        out,
        settings=ExtractSettings.defaults(model_path=tiny_model, layers=layers, batch_tokens=256, dtype="float32"),
        model=loaded,
        selection_digest="abc",
    )
    T = sum(len(r["input_ids"]) for r in rows)
    assert info["num_tokens"] == T and info["num_samples"] == len(rows) and info["batches"] > 1
    assert info["forwarded_tokens"] == T and info["reused_tokens"] == 0
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
    # the default final_norm both: the final norm's input, its weight and epsilon, and the formula measured
    assert meta["final_norm"] == "both" and "output of 0-based decoder layer" in meta["layer_convention"]
    assert meta["norm_formula"] == "llama" and float(meta["norm_eps"]) == loaded[1].norm.variance_epsilon
    assert torch.equal(t["final_norm_weight"], loaded[1].norm.weight.float())
    check = json.loads(meta["norm_check"])
    assert check["rows"] > 0 and check["llama"] == {"max_ulp": 0, "exact_share": 1.0}
    assert check["gemma"]["max_ulp"] > 1  # the (1 + w) formula is measurably another norm
    assert "hidden_states_post" not in t and json.loads(meta["drafter_layers"]) == {"eagle3": layers}
    assert (meta["num_tokens"], meta["num_samples"], meta["dtype"]) == (str(T), str(len(rows)), "float32")
    assert meta["model_path"] == str(tiny_model) and meta["num_layers"] == str(L)
    assert meta["format"] == ex.FORMAT and meta["selection_digest"] == "abc"
    assert meta["state_settings"] == ex.settings_digest(
        backend="transformers",
        fingerprint=ex.model_fingerprint(tiny_model),
        layers=layers,
        dtype="float32",
        final_norm="both",
        final_states="all",
        aux_format="same",
    )

    model, decoder = loaded
    for n, r in enumerate(rows):
        s, e = off[n].item(), off[n + 1].item()
        assert t["input_ids"][s:e].tolist() == r["input_ids"]
        assert t["loss_mask"][s:e].tolist() == r["loss_mask"]
        hs = reference_states(model, r["input_ids"])
        for j, layer in enumerate(layers):
            got = t["aux_hidden_states"][s:e, j * H : (j + 1) * H]
            torch.testing.assert_close(got, hs[layer + 1][0], atol=1e-5, rtol=1e-5)
            # the other convention (input of layer i) is measurably different: the test can tell them apart
            assert (got - hs[layer][0]).abs().max() > 1e-2
        # stored: the norm's input (pre-norm); the model's own norm of it is HF's last hidden state. Not bit for
        # bit: the packed, batched forward and HF's per-sample one run other float32 kernels on some CPUs
        # (AVX-512 differs by up to 6e-6); within one forward the norm is exact (norm_check above)
        with torch.inference_mode():
            torch.testing.assert_close(decoder.norm(t["hidden_states"][s:e]), hs[-1][0], atol=1e-5, rtol=1e-5)
        assert (t["hidden_states"][s:e] - hs[-1][0]).abs().max() > 1e-2

    # the reader gives the same per sample, memory-mapped, in either final form (post derived bit-exactly)
    with ex.StatesFile(out) as sf:
        assert sf.index["s3"] == 3 and sf.same_settings(meta["state_settings"]) and sf.final_forms == {"post", "pre"}
        one = sf.sample(3)
        s, e = off[3].item(), off[4].item()
        assert torch.equal(one["aux_hidden_states"], t["aux_hidden_states"][s:e])
        assert one["input_ids"].tolist() == rows[3]["input_ids"]
        assert torch.equal(one["hidden_states"], t["hidden_states"][s:e])
        assert torch.equal(sf.sample(3, final="pre")["hidden_states"], t["hidden_states"][s:e])
        hs = reference_states(model, rows[3]["input_ids"])
        post = sf.sample(3, final="post")["hidden_states"]
        with torch.inference_mode():
            assert torch.equal(post, decoder.norm(t["hidden_states"][s:e]))  # the model's own norm, bit for bit
        torch.testing.assert_close(post, hs[-1][0], atol=1e-5, rtol=1e-5)
        two = sf.sample(3, layers=[4, 0])  # a drafter's layers, picked from the stored columns in its order
        assert torch.equal(
            two["aux_hidden_states"],
            torch.cat([t["aux_hidden_states"][s:e, 2 * H :], t["aux_hidden_states"][s:e, :H]], dim=1),
        )
        with pytest.raises(ValueError, match="layers \\[3\\] are not stored.*extract.drafters"):
            sf.sample(3, layers=[3])
    whole, _ = ex.load_states(out, final="post")
    assert torch.equal(whole["hidden_states"][s:e], post)


def test_batched_equals_one_at_a_time_and_default_layers(tmp_path, tiny_model, loaded, merged):
    path, rows = merged
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    ia = ex.extract_states(
        path,
        a,
        settings=ExtractSettings.defaults(model_path=tiny_model, batch_tokens=4096, dtype="float32"),
        model=loaded,
    )
    ib = ex.extract_states(
        path, b, settings=ExtractSettings.defaults(model_path=tiny_model, batch_tokens=1, dtype="float32"), model=loaded
    )
    assert ia["batches"] < ib["batches"] == len(rows)
    assert ia["layers"] == [1, 2]
    ta, ma = ex.read_hidden_states(a)
    tb_, mb = ex.read_hidden_states(b)
    assert ta["aux_hidden_states"].shape == (ia["num_tokens"], 2 * H)
    for k in ta:
        torch.testing.assert_close(ta[k], tb_[k], atol=1e-5, rtol=1e-5)
    # the same file but the rows the first batch's norm check saw (one batch of different sizes)
    assert json.loads(ma.pop("norm_check"))["rows"] > json.loads(mb.pop("norm_check"))["rows"] > 0
    assert ma == mb


def test_rerun_forwards_only_new_or_longer_samples(tmp_path, tiny_model, loaded):
    """The GPU-work contract of a rerun: equal samples are copied byte for byte, truncations are cut from the
    stored rows, and only samples never computed (or now longer) pass through the model."""
    rows = make_rows(10, seed=5)
    sel = write_selection(tmp_path / "sel.parquet", rows)
    out, stash = tmp_path / "hs" / "d" / "000.safetensors", tmp_path / "cache" / "d" / "000.safetensors"
    settings = ExtractSettings.defaults(tiny_model, layers=[1, 3, 4], batch_tokens=200, dtype="float32")
    kw = dict(settings=settings, model=loaded)
    counter = TokenCounter(loaded[1])
    try:
        first = ex.extract_states(sel, out, reuse_path=stash, **kw)
        all_tokens = sum(r["num_tokens"] for r in rows)
        assert counter.tokens == first["forwarded_tokens"] == all_tokens
        # the job keeps a hard link of its output: same inode, no extra space
        assert os.stat(out).st_ino == os.stat(stash).st_ino
        old = {k: v.clone() for k, v in ex.read_hidden_states(out)[0].items()}
        old_off = old["sample_offsets"].tolist()

        # Snakemake deletes the output before rerunning; the selection changes: one sample dropped (cap), one
        # cut (max_len), one new (a retried request), the rest the same
        os.unlink(out)
        new_row = make_rows(1, seed=99, prefix="new")[0]
        c = max(range(len(rows)), key=lambda k: rows[k]["num_tokens"])  # cut the longest
        n_cut = rows[c]["num_tokens"] // 2
        cut = dict(
            rows[c],
            input_ids=rows[c]["input_ids"][:n_cut],
            loss_mask=rows[c]["loss_mask"][:n_cut],
            num_tokens=n_cut,
            num_supervised=sum(rows[c]["loss_mask"][:n_cut]),
            truncated=True,
        )
        if cut["num_supervised"] == 0:  # merge would drop it; give it a (different) mask: not reusable
            cut["loss_mask"] = [0] * (n_cut - 1) + [1]
            cut["num_supervised"] = 1
        drop = 2 if c != 2 else 3
        new_rows = [r for k, r in enumerate(rows) if k not in (drop, c)] + [cut, new_row]
        sel2 = write_selection(tmp_path / "sel2.parquet", new_rows)
        counter.tokens = 0
        second = ex.extract_states(sel2, out, reuse_path=stash, **kw)
        changed = new_row["num_tokens"] + (n_cut if cut["loss_mask"] != rows[c]["loss_mask"][:n_cut] else 0)
        assert counter.tokens == second["forwarded_tokens"] == changed
        assert second["reused_tokens"] == sum(r["num_tokens"] for r in new_rows) - changed
        t2, _ = ex.read_hidden_states(out)
        post2 = ex.load_states(out, final="post")[0]["hidden_states"]  # derived from the stored pre-norm rows
        off2 = t2["sample_offsets"].tolist()
        old_pos = {r["sample_id"]: k for k, r in enumerate(rows)}
        for k, r in enumerate(new_rows):
            s, e = off2[k], off2[k + 1]
            if r["sample_id"] in old_pos and (r is not cut or changed == new_row["num_tokens"]):
                j = old_pos[r["sample_id"]]  # reused (whole, or the truncation's prefix): the very same bytes
                assert torch.equal(
                    t2["aux_hidden_states"][s:e], old["aux_hidden_states"][old_off[j] : old_off[j] + e - s]
                )
                assert torch.equal(t2["hidden_states"][s:e], old["hidden_states"][old_off[j] : old_off[j] + e - s])
            ref = reference_states(loaded[0], r["input_ids"])  # and every sample still equals a fresh forward
            torch.testing.assert_close(t2["aux_hidden_states"][s:e, H : 2 * H], ref[4][0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(post2[s:e], ref[-1][0], atol=1e-5, rtol=1e-5)
        assert os.stat(out).st_ino == os.stat(stash).st_ino  # the link follows the new file

        # the same selection again, nothing stored but the link: nothing forwarded, no model needed
        os.unlink(out)
        counter.tokens = 0
        third = ex.extract_states(
            sel2,
            out,
            reuse_path=stash,
            settings=ExtractSettings.defaults(
                model_path=tiny_model, layers=[1, 3, 4], batch_tokens=200, dtype="float32"
            ),
        )
        assert counter.tokens == 0 and third["forwarded_tokens"] == 0 and third["device"] == "none"
        assert torch.equal(ex.read_hidden_states(out)[0]["aux_hidden_states"], t2["aux_hidden_states"])

        # other settings (layers): nothing reusable, everything forwarded
        counter.tokens = 0
        fourth = ex.extract_states(
            sel2,
            tmp_path / "other.safetensors",
            reuse_path=stash,
            **dict(kw, settings=settings.replace(layers=[0, 2, 4])),
        )
        assert fourth["reused_tokens"] == 0 and counter.tokens == sum(r["num_tokens"] for r in new_rows)
    finally:
        counter.remove()


def test_reuse_keeps_storage_savers_exact(tmp_path, tiny_model):
    """fp8 auxiliary states and supervised-only final rows are copied byte for byte, truncations included."""
    loaded16 = tb.load_target(tiny_model, dtype="bfloat16", device="cpu")
    rows = make_rows(6, seed=8)
    kw = dict(
        settings=ExtractSettings.defaults(
            tiny_model, layers=[1, 2, 3], dtype="bfloat16", final_states="supervised", aux_format="fp8_e4m3"
        ),
        model=loaded16,
    )
    a = tmp_path / "a.safetensors"
    ex.extract_states(write_selection(tmp_path / "a.parquet", rows), a, **kw)
    longest = max(range(len(rows)), key=lambda k: rows[k]["num_tokens"])
    r = rows[longest]
    n = r["num_tokens"] - 2
    cut = dict(
        r,
        input_ids=r["input_ids"][:n],
        loss_mask=r["loss_mask"][:n],
        num_tokens=n,
        num_supervised=sum(r["loss_mask"][:n]),
        truncated=True,
    )
    ta, _ = ex.load_states(a)
    b = tmp_path / "b.safetensors"
    info = ex.extract_states(write_selection(tmp_path / "b.parquet", [cut]), b, reuse_path=a, **kw)
    assert info["forwarded_tokens"] == 0 and info["reused_tokens"] == n
    assert os.stat(a).st_ino == os.stat(b).st_ino  # reuse_path now links the new output
    tb_, meta = ex.load_states(b)
    s = ta["sample_offsets"][longest].item()
    assert meta["aux_format"] == "fp8_e4m3" and meta["final_states"] == "supervised"
    assert torch.equal(tb_["aux_hidden_states"], ta["aux_hidden_states"][s : s + n])
    assert torch.equal(tb_["final_mask"], ta["final_mask"][s : s + n])
    assert torch.equal(tb_["hidden_states"], ta["hidden_states"][s : s + n])


def test_bf16_and_crash_leaves_no_file(tmp_path, tiny_model, merged, monkeypatch):
    path, rows = merged
    loaded16 = tb.load_target(tiny_model, dtype="bfloat16", device="cpu")
    out = tmp_path / "bf.safetensors"
    ex.extract_states(
        path,
        out,
        settings=ExtractSettings.defaults(model_path=tiny_model, layers=[1, 2, 3], dtype="bfloat16"),
        model=loaded16,
    )
    t, meta = ex.read_hidden_states(out)
    assert t["aux_hidden_states"].dtype == torch.bfloat16 and meta["dtype"] == "bfloat16"
    assert torch.isfinite(t["aux_hidden_states"].float()).all()

    # a crash mid-shard: no output, no leftover temporary file
    calls = {"n": 0}
    real = tb.Capture._hook

    def flaky(self, key):
        fn = real(self, key)

        def wrapped(module, args, output):
            if key == "final":
                calls["n"] += 1
                if calls["n"] == 2:
                    raise RuntimeError("simulated crash")
            return fn(module, args, output)

        return wrapped

    monkeypatch.setattr(tb.Capture, "_hook", flaky)
    crash = tmp_path / "crash" / "000.safetensors"
    with pytest.raises(RuntimeError, match="simulated crash"):
        ex.extract_states(
            path,
            crash,
            settings=ExtractSettings.defaults(model_path=tiny_model, batch_tokens=128, dtype="bfloat16"),
            model=loaded16,
        )
    assert not crash.exists()
    assert list(crash.parent.iterdir()) == []


def test_empty_selection_and_bad_ids(tmp_path, tiny_model, loaded):
    empty = write_selection(tmp_path / "empty.parquet", [])
    out = tmp_path / "empty.safetensors"
    info = ex.extract_states(
        empty, out, settings=ExtractSettings.defaults(model_path=tiny_model, dtype="float32"), model=loaded
    )
    t, meta = ex.read_hidden_states(out)
    assert info["num_tokens"] == 0 and t["aux_hidden_states"].shape == (0, 2 * H)
    assert t["sample_offsets"].tolist() == [0] and meta["num_samples"] == "0"

    bad = write_selection(
        tmp_path / "bad.parquet",
        [
            {
                "sample_id": "x",
                "dataset": "d",
                "input_ids": [1, V + 5],
                "loss_mask": [0, 1],
                "num_tokens": 2,
                "num_supervised": 1,
                "truncated": False,
            }
        ],
    )
    with pytest.raises(ValueError, match="vocabulary"):
        ex.extract_states(
            bad,
            tmp_path / "bad.safetensors",
            settings=ExtractSettings.defaults(model_path=tiny_model, dtype="float32"),
            model=loaded,
        )
    assert not (tmp_path / "bad.safetensors").exists()
    with pytest.raises(ValueError, match="backend"):
        ex.extract_states(
            empty, out, settings=ExtractSettings.defaults(model_path=tiny_model, backend="vllm", dtype="float32")
        )


def test_keep_link_across_filesystems_turns_reuse_off(tmp_path, monkeypatch):
    from eagle3_data.extract import stage

    out, link = tmp_path / "out.bin", tmp_path / "cache" / "out.bin"
    out.write_bytes(b"new")
    link.parent.mkdir()
    link.write_bytes(b"old")  # an older link must not keep its disk space when no new link can be made

    def exdev(src, dst):
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(stage.os, "link", exdev)
    assert stage.keep_link(out, link) is False
    assert not link.exists() and out.read_bytes() == b"new"


def test_settings_digest_of_files_before_v3_is_kept():
    """A v2 file computed with the same settings stays reusable: the digest names the rows' encoding (unchanged
    since v2) and leaves out final_format at its default. The literal is the v2 stage's digest of these inputs."""
    kw = dict(
        backend="transformers",
        fingerprint="abc",
        layers=[1, 15, 28],
        dtype="bfloat16",
        final_norm="post",
        final_states="all",
        aux_format="same",
    )
    assert ex.settings_digest(**kw) == "e194424249330900"
    assert ex.settings_digest(**kw, final_format="fp8_e4m3") != ex.settings_digest(**kw)


def test_dflash_layers_follow_specforge():
    """SpecForge 0.2.0's build_target_layer_ids (specforge/modeling/draft/dflash.py), with Python's round."""
    assert ex.dflash_layer_ids(36) == [1, 9, 17, 25, 33]  # SpecForge configs/qwen3-8b-dspark.json target_layer_ids
    assert ex.dflash_layer_ids(32) == [1, 8, 15, 22, 29]
    assert ex.dflash_layer_ids(30) == [1, 8, 14, 20, 27]  # 7.5 -> 8 and 20.5 -> 20: round half to even
    assert ex.dflash_layer_ids(61, 1) == [30]
    assert ex.dflash_layer_ids(6) == [1, 2, 2, 2, 3]  # a shallow target repeats layers, as SpecForge does
    with pytest.raises(ValueError, match="extract.dflash_layers"):
        ex.dflash_layer_ids(2)
    union, per = ex.resolve_drafter_layers(["eagle3", "dflash", "dspark"], None, None, 32)
    assert per == {"eagle3": [1, 15, 28], "dflash": [1, 8, 15, 22, 29], "dspark": [1, 8, 15, 22, 29]}
    assert union == [1, 15, 28, 8, 22, 29]  # stored once: EAGLE-3's in their order, then the rest ascending
    assert ex.resolve_drafter_layers(["dflash"], None, [4, 2, 4], 6) == ([2, 4], {"dflash": [4, 2, 4]})
    with pytest.raises(ValueError, match="outside"):
        ex.resolve_drafter_layers(["dspark"], None, [9], 6)


def test_one_capture_serves_every_drafter(tmp_path, tiny_model, loaded, merged):
    """drafters eagle3 + dflash + dspark: the union of their layers stored once, each drafter's read back from it
    equal to HF's hidden_states[i + 1] (SpecForge's DFlash offset-1 convention)."""
    path, rows = merged
    out = tmp_path / "all.safetensors"
    info = ex.extract_states(
        path,
        out,
        model=loaded,
        settings=ExtractSettings.defaults(
            model_path=tiny_model, dtype="float32", layers=[1, 3, 4], drafters=["eagle3", "dflash", "dspark"]
        ),
    )
    assert info["layers"] == [1, 3, 4, 2] and info["drafter_layers"]["dflash"] == [1, 2, 2, 2, 3]
    with ex.StatesFile(out) as sf:
        assert sf.layers == [1, 3, 4, 2] and sf.drafter_layers == info["drafter_layers"]
        assert sf.tensors["aux_hidden_states"][1] == [info["num_tokens"], 4 * H]
        for j in (0, 5):
            ref = reference_states(loaded[0], rows[j]["input_ids"])
            for drafter, layers in sf.drafter_layers.items():
                got = sf.sample(j, layers=layers)["aux_hidden_states"]
                want = torch.cat([ref[x + 1][0] for x in layers], dim=-1)
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # the settings' params change only for a drafter other than eagle3 (so a default config keeps its params)
    base = ExtractSettings.defaults(model_path=tiny_model)
    assert "drafters" not in base.params() and "dflash_layers" not in base.params()
    assert base.replace(drafters=["eagle3", "dspark"]).params()["dflash_layers"] is None


def test_fp8_final_states(tmp_path, tiny_model, merged):
    """final_format fp8_e4m3: one scale per stored row; both final forms read back within fp8's error."""
    path, rows = merged
    loaded16 = tb.load_target(tiny_model, dtype="bfloat16", device="cpu")
    ref_file, fp8_file = tmp_path / "bf16.safetensors", tmp_path / "fp8.safetensors"
    base = ExtractSettings.defaults(model_path=tiny_model, dtype="bfloat16", layers=[1, 2, 3])
    ex.extract_states(path, ref_file, settings=base, model=loaded16)
    ex.extract_states(
        path,
        fp8_file,
        settings=base.replace(final_format="fp8_e4m3", aux_format="fp8_e4m3", final_states="supervised"),
        model=loaded16,
    )
    t, meta = ex.read_hidden_states(fp8_file)
    S = int(t["final_mask"].sum())
    assert t["hidden_states"].dtype == torch.float8_e4m3fn and t["hidden_states"].shape == (S, H)
    assert t["final_scales"].shape == (S,) and t["final_scales"].dtype == torch.float32
    assert meta["final_format"] == "fp8_e4m3"
    for final in ("pre", "post"):
        want = ex.load_states(ref_file, final=final)[0]["hidden_states"].float()
        got, _ = ex.load_states(fp8_file, final=final)
        keep = got["final_mask"]
        err = (got["hidden_states"].float()[keep] - want[keep]).norm() / want[keep].norm()
        assert 0 < err < 0.05, (final, float(err))  # e4m3: 3 mantissa bits, about 2-3% relative
        assert (got["hidden_states"][~keep] == 0).all()


def test_final_norm_no_formula_stores_post_rows(tmp_path, tiny_model, merged):
    """A final norm none of the RMSNorm formulas reproduces (here: mean-subtracted) is found on the first batch:
    its output is stored beside its input, and the readers return the model's own output."""
    path, rows = merged
    model, decoder = tb.load_target(tiny_model, dtype="float32", device="cpu")
    norm = decoder.norm

    def layer_norm_like(x):
        xf = x.float() - x.float().mean(-1, keepdim=True)
        return (norm.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6))).to(x.dtype)

    norm.forward = layer_norm_like
    out = tmp_path / "ln.safetensors"
    info = ex.extract_states(
        path, out, model=(model, decoder), settings=ExtractSettings.defaults(model_path=tiny_model, dtype="float32")
    )
    assert info["norm_formula"] == "none"
    t, meta = ex.read_hidden_states(out)
    assert meta["norm_formula"] == "none" and t["hidden_states_post"].shape == t["hidden_states"].shape
    with ex.StatesFile(out) as sf:
        ref = reference_states(model, rows[2]["input_ids"])
        # stored post-norm states from the batched forward: HF's per-sample forward within float32 rounding
        torch.testing.assert_close(sf.sample(2, final="post")["hidden_states"], ref[-1][0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(layer_norm_like(sf.sample(2, final="pre")["hidden_states"]), ref[-1][0])


def test_reader_refuses_a_form_it_cannot_serve_and_reads_v2(tmp_path, tiny_model, loaded, merged):
    path, rows = merged
    post = tmp_path / "post.safetensors"
    ex.extract_states(
        path,
        post,
        model=loaded,
        settings=ExtractSettings.defaults(model_path=tiny_model, dtype="float32", final_norm="post"),
    )
    with ex.StatesFile(post) as sf:
        assert sf.final_forms == {"post"}
        with pytest.raises(ValueError, match="post-norm final states, not pre-norm.*extract.final_norm: both"):
            sf.sample(0, final="pre")
    # a v2 file (before drafter layers): read as before, its layers taken as EAGLE-3's
    from safetensors.torch import save_file

    t, meta = ex.read_hidden_states(post)
    meta = {k: v for k, v in meta.items() if k not in ("drafter_layers", "final_format")}
    v2 = tmp_path / "v2.safetensors"
    save_file(t, str(v2), metadata={**meta, "format": "eagle3-data/hidden-states/v2"})
    with ex.StatesFile(v2) as sf:
        assert sf.drafter_layers == {"eagle3": [1, 2]} and sf.final_forms == {"post"}
        assert torch.equal(sf.sample(1, final="post")["hidden_states"], ex.StatesFile(post).sample(1)["hidden_states"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_norm_formulas_match_the_transformers_classes(dtype):
    """Each RMSNorm class is found as its own formula, bit-exactly, on rows with outlier channels; the llama and
    weight_in_fp32 formulas differ by at most one ULP in reduced precision, so the bit-exact share decides."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    from eagle3_data.extract.norm import apply_norm, check_formulas, norm_params, pick_formula

    torch.manual_seed(0)
    want = {LlamaRMSNorm: "llama", Qwen3RMSNorm: "llama", GptOssRMSNorm: "weight_in_fp32", Gemma3RMSNorm: "gemma"}
    x = torch.randn(300, 256) * torch.logspace(-2, 2, 300)[:, None]
    x[:, 7] *= 50  # an outlier channel
    x = x.to(dtype)
    for cls, formula in want.items():
        m = cls(256, eps=1e-6)
        with torch.no_grad():
            m.weight.copy_(torch.randn(256) * 0.5 + (0.0 if cls is Gemma3RMSNorm else 1.0))
        m = m.to(dtype)
        with torch.no_grad():
            y = m(x)
        w, eps = norm_params(m)
        got = check_formulas(x, y, w, eps, dtype, chunk_rows=77)
        expect = formula if dtype != torch.float32 or formula == "gemma" else "llama"  # fp32: llama == in_fp32
        assert pick_formula(got) == expect, (cls.__name__, got)
        assert got[formula] == {"max_ulp": 0, "exact_share": 1.0}
        assert torch.equal(apply_norm(x, w, eps, formula), y)
    assert pick_formula({"llama": {"max_ulp": 3, "exact_share": 0.9}}) == "none"
