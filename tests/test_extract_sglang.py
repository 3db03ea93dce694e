"""SGLang extraction backend: importable without sglang, capture checks, same file as transformers (fake
capture on CPU); the real SGLang run is GPU-marked."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
import torch

from conftest import save_tiny_llama
from eagle3_data import extract as ex
from eagle3_data import schemas
from eagle3_data.extract import batching
from eagle3_data.extract import sglang_backend as sx
from eagle3_data.extract.transformers_backend import load_target

H, L, V = 32, 8, 300
LAYERS = [1, 3, 4]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-llama", hidden_size=H, num_layers=L,
                           vocab_size=V, seed=2)


@pytest.fixture(scope="module")
def merged(tmp_path_factory):
    rng = random.Random(7)
    rows = []
    for i in range(11):
        n = rng.choice([3, 9, 40, 70])
        p = rng.randint(1, n - 1)
        rows.append({"sample_id": f"g{i}", "dataset": "d", "input_ids": [rng.randrange(V) for _ in range(n)],
                     "loss_mask": [0] * p + [1] * (n - p), "num_tokens": n, "num_supervised": n - p,
                     "truncated": False})
    path = tmp_path_factory.mktemp("merged") / "000.parquet"
    schemas.write_checked(schemas.from_rows(rows, schemas.MERGED), "merged", path)
    return path, rows


def hf_capture(model, layers, short_by=0):
    """A stand-in for the SGLang runner: one unpadded HF forward per sample (what SGLang's ragged prefill
    computes), returning (aux, final) lists; ``short_by`` drops rows like a prefix-cache hit would."""

    def capture(id_lists):
        aux, fin = [], []
        for ids in id_lists:
            with torch.inference_mode():
                hs = model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
            a = torch.cat([hs[i + 1][0] for i in layers], dim=-1)
            aux.append(a[short_by:])
            fin.append(hs[-1][0][short_by:])
        return aux, fin

    return capture


def test_importable_without_sglang_and_server_args():
    code = ("import sys; sys.modules['sglang'] = None\n"
            "import eagle3_data.extract.sglang_backend as m; print(m.sglang_available())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    args = sx.server_args("/m", tp_size=8, max_len=4096, batch_tokens=1000)
    assert args["disable_radix_cache"] is True and args["chunked_prefill_size"] == -1
    assert args["enable_return_hidden_states"] is True and args["tp_size"] == 8
    assert args["context_length"] == 4097 and args["max_total_tokens"] == 4097
    with pytest.raises(ValueError):
        sx.server_args("/m", tp_size=0)


def test_token_batches_and_check_capture():
    lengths = [5, 100, 7, 30, 31, 2, 99, 400]
    batches = batching.packed_batches(lengths, 128)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    assert all(len(b) == 1 or sum(lengths[i] for i in b) <= 128 for b in batches)
    ok = [torch.zeros(3, 2 * 4)], [torch.zeros(3, 4)]
    sx.check_capture(["a"], [3], *ok, num_aux=2, hidden_size=4)
    with pytest.raises(RuntimeError, match="capture length must equal input length"):
        sx.check_capture(["a"], [4], *ok, num_aux=2, hidden_size=4)
    with pytest.raises(RuntimeError, match="widths"):
        sx.check_capture(["a"], [3], *ok, num_aux=3, hidden_size=4)


def test_fake_capture_writes_the_transformers_file(tmp_path, tiny_model, merged):
    path, rows = merged
    loaded = load_target(tiny_model, dtype="float32", device="cpu")
    ref = tmp_path / "hf.safetensors"
    ex.extract_states(path, ref, model_path=tiny_model, layers=LAYERS, model=loaded)
    out = tmp_path / "sg.safetensors"
    info = ex.extract_states(path, out, model_path=tiny_model, layers=LAYERS, dtype="float32", batch_tokens=100,
                             backend="sglang", capture=hf_capture(loaded[0], LAYERS))
    assert info["backend"] == "sglang" and info["batches"] > 1
    ta, ma = ex.read_hidden_states(ref)
    tb, mb = ex.read_hidden_states(out)
    for k in ta:
        torch.testing.assert_close(ta[k], tb[k], atol=1e-5, rtol=1e-5)
    assert mb["backend"] == "sglang" and mb["layers"] == ma["layers"] and mb["sample_ids"] == ma["sample_ids"]
    assert mb["state_settings"] != ma["state_settings"]  # rows of one backend are never reused for the other

    # a short capture (prefix-cache symptom) fails the shard and leaves no file
    bad = tmp_path / "bad" / "000.safetensors"
    with pytest.raises(RuntimeError, match="capture length must equal input length"):
        ex.extract_states(path, bad, model_path=tiny_model, layers=LAYERS, dtype="float32", backend="sglang",
                          capture=hf_capture(loaded[0], LAYERS, short_by=1))
    assert not bad.exists() and list(bad.parent.iterdir()) == []
    with pytest.raises(ValueError, match="post-norm"):
        ex.extract_states(path, bad, model_path=tiny_model, backend="sglang", final_norm="pre")


@pytest.mark.gpu
def test_sglang_matches_transformers_on_gpu(tmp_path, tiny_model, merged):
    if not torch.cuda.is_available() or not sx.sglang_available():
        pytest.skip("needs a CUDA device and sglang (envs/sglang-gpu.yaml)")
    path, rows = merged
    ref = tmp_path / "hf.safetensors"
    ex.extract_states(path, ref, model_path=tiny_model, layers=LAYERS, dtype="bfloat16", device="cuda", gpus=1)
    out = tmp_path / "sg.safetensors"
    info = ex.extract_states(path, out, model_path=tiny_model, layers=LAYERS, dtype="bfloat16", device="cuda",
                             gpus=1, backend="sglang")
    assert info["num_tokens"] == sum(len(r["input_ids"]) for r in rows)
    ta, _ = ex.read_hidden_states(ref)
    tb, mb = ex.read_hidden_states(out)
    assert torch.equal(ta["input_ids"], tb["input_ids"]) and mb["backend"] == "sglang"
    for k in ("aux_hidden_states", "hidden_states"):
        cos = torch.nn.functional.cosine_similarity(ta[k].float(), tb[k].float(), dim=-1)
        assert cos.min() > 0.99, (k, cos.min())
