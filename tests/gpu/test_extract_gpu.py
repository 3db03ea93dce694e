"""Extraction on a CUDA device (all `gpu`-marked; skipped without one): stored states equal HF
``output_hidden_states[i + 1]``, batched == one sample at a time in bf16 for every layout and kernel, the
overlapped writeback writes the same bytes as in-order writes, and device locks with the machine's real GPUs.

Runs with only torch, transformers, safetensors, numpy, pyarrow and pytest (the GPU machine's packages):
``PYTHONPATH=src python benchmarks/extract_gpu.py --gpu-tests`` runs this file with the project's other
dependencies made unimportable (benchmarks/extract_gpu.sh does, the FlexAttention cases, which compile, last:
``-k flex``).

bf16 tolerance (stated): per sample and tensor, max |batched - single| <= 2^-5 x max |single| (8 units of
bf16's 2^-8 spacing at the tensor's scale), and the same bound for each bf16 result against the fp32 forward of
the sample alone. On CPU the same tiny model gives 0.7% (batched vs single) and 1.3% (bf16 vs fp32).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

from eagle3_data import extract as ex
from eagle3_data import schemas
from eagle3_data.settings import ExtractSettings
from eagle3_data.extract import layout
from eagle3_data.extract import transformers_backend as tb
from eagle3_data.files import write_parquet

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

H, L, V, MAX_LEN = 128, 6, 300, 1024  # head size 32 (FlashAttention: a multiple of 8), GQA 4:2
LAYERS = [1, 2, 4]
LENGTHS = [1, MAX_LEN, 7, 130, 64, 3, 300, 33, 1, 520, 129]
BF16_TOL = 2.0**-5
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A random Llama with the default (well-conditioned) init, so bf16 rounding stays at bf16's scale."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(11)
    cfg = LlamaConfig(
        hidden_size=H,
        intermediate_size=2 * H,
        num_hidden_layers=L,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=V,
        max_position_embeddings=MAX_LEN,
    )
    path = tmp_path_factory.mktemp("gpu") / "tiny-llama"
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def rows():
    rng = random.Random(5)
    out = []
    for i, n in enumerate(LENGTHS):
        p = rng.randint(0, n - 1)
        out.append(
            {
                "sample_id": f"g{i}",
                "dataset": "d",
                "input_ids": [rng.randrange(V) for _ in range(n)],
                "loss_mask": [0] * p + [1] * (n - p),
                "num_tokens": n,
                "num_supervised": n - p,
                "truncated": False,
            }
        )
    return out


@pytest.fixture(scope="module")
def selection(tmp_path_factory, rows):
    path = tmp_path_factory.mktemp("sel") / "000.parquet"
    write_parquet(schemas.from_rows(rows, schemas.MERGED), path)  # no pandera on a GPU machine: no value check
    return path


@pytest.fixture(scope="module")
def fp32(model_dir):
    return tb.load_target(model_dir, dtype="float32", device="cuda")


@pytest.fixture(scope="module")
def bf16(model_dir):
    return tb.load_target(model_dir, dtype="bfloat16", device="cuda")


def extract(selection, out, model_dir, loaded, overlap=True, **kw):
    settings = ExtractSettings.defaults(model_dir, **{"layers": LAYERS, "dtype": "float32", "final_norm": "post", **kw})
    info = ex.extract_states(selection, out, settings=settings, model=loaded, overlap=overlap)
    return info, ex.read_hidden_states(out)[0]


def rel(a, b) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


@pytest.mark.parametrize("attention", ["padded", "packed-flex", "packed-loop"])
def test_gpu_aux_equals_hf_output_hidden_states_fp32(tmp_path, model_dir, fp32, rows, selection, attention):
    info, t = extract(
        selection, tmp_path / "a.safetensors", model_dir, fp32, dtype="float32", attention=attention, batch_tokens=1500
    )
    assert info["attention"] == ("padded" if attention == "padded" else "packed:" + attention.split("-")[1])
    assert info["device"].startswith("cuda") and info["batches"] < len(rows)
    off = t["sample_offsets"].tolist()
    model = fp32[0]
    for n, r in enumerate(rows):
        with torch.inference_mode():
            hs = model(input_ids=torch.tensor([r["input_ids"]], device="cuda"), output_hidden_states=True).hidden_states
        s, e = off[n], off[n + 1]
        for j, layer in enumerate(LAYERS):
            torch.testing.assert_close(
                t["aux_hidden_states"][s:e, j * H : (j + 1) * H], hs[layer + 1][0].cpu(), rtol=1e-4, atol=1e-4
            )
        torch.testing.assert_close(t["hidden_states"][s:e], hs[-1][0].cpu(), rtol=1e-4, atol=1e-4)
    assert model.config._attn_implementation == "sdpa"


@pytest.fixture(scope="module")
def references(tmp_path_factory, model_dir, fp32, bf16, selection):
    """The fp32 and the bf16 states of each sample forwarded alone: ``(ref, single)`` tensor dicts."""
    tmp = tmp_path_factory.mktemp("refs")
    _, ref = extract(
        selection, tmp / "ref.safetensors", model_dir, fp32, dtype="float32", attention="padded", batch_tokens=1
    )
    _, single = extract(
        selection, tmp / "single.safetensors", model_dir, bf16, dtype="bfloat16", attention="padded", batch_tokens=1
    )
    return ref, single


@pytest.mark.parametrize("attention", ["padded", "packed", "packed-varlen", "packed-flex", "packed-loop"])
def test_gpu_batched_equals_single_bf16(tmp_path, model_dir, bf16, selection, references, attention):
    ref, single = references
    off = ref["sample_offsets"].tolist()
    info, t = extract(
        selection,
        tmp_path / "batched.safetensors",
        model_dir,
        bf16,
        dtype="bfloat16",
        attention=attention,
        batch_tokens=1500,
    )
    # auto-picked kernel on CUDA in bf16: FlashAttention varlen; several samples per forward
    want = {"padded": "padded", "packed": "packed:varlen"}.get(attention, "packed:" + attention.split("-")[-1])
    assert info["attention"] == want and info["batches"] < len(LENGTHS)
    for k in ("aux_hidden_states", "hidden_states"):
        for n in range(len(LENGTHS)):
            s, e = off[n], off[n + 1]
            got, one, f32 = t[k][s:e], single[k][s:e], ref[k][s:e]
            assert rel(got, one) <= BF16_TOL, (attention, k, n, rel(got, one))
            assert rel(got, f32) <= BF16_TOL, (attention, k, n, rel(got, f32))
            assert rel(one, f32) <= BF16_TOL, (k, n, rel(one, f32))


@pytest.mark.parametrize("savers", [{}, {"final_states": "supervised", "aux_format": "fp8_e4m3"}])
@pytest.mark.parametrize("attention", ["packed", "padded"])
def test_gpu_overlapped_writeback_writes_the_same_bytes(tmp_path, model_dir, bf16, selection, attention, savers):
    kw = dict(dtype="bfloat16", attention=attention, batch_tokens=600, **savers)
    a, b = tmp_path / "overlap.safetensors", tmp_path / "inorder.safetensors"
    ia, _ = extract(selection, a, model_dir, bf16, overlap=True, **kw)
    extract(selection, b, model_dir, bf16, overlap=False, **kw)
    assert a.read_bytes() == b.read_bytes()
    assert ia["batches"] > 2 and ia["timing"]["copy_s"] > 0 and ia["timing"]["write_s"] > 0


def test_gpu_writer_error_leaves_no_file(tmp_path, model_dir, bf16, selection, monkeypatch):
    calls = {"n": 0}
    real = layout.HiddenStateWriter.put

    def failing(self, i, parts):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(28, "No space left on device (simulated)")
        return real(self, i, parts)

    monkeypatch.setattr(layout.HiddenStateWriter, "put", failing)
    out = tmp_path / "hs" / "000.safetensors"
    out.parent.mkdir()
    with pytest.raises(OSError, match="No space left"):
        extract(selection, out, model_dir, bf16, dtype="bfloat16", attention="packed", batch_tokens=300)
    assert list(out.parent.iterdir()) == []


HOLDER = textwrap.dedent("""
    import json, sys, time, torch
    from eagle3_data.extract import device_context
    n, lock_dir, release = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    import os
    with device_context("cuda", n, lock_dir) as (dev, ids):
        print(json.dumps({"dev": dev, "ids": ids, "cvd": os.environ.get("CUDA_VISIBLE_DEVICES"),
                          "count": torch.cuda.device_count(), "x": float(torch.ones(4, device="cuda").sum())}),
              flush=True)
        while not os.path.exists(release):
            time.sleep(0.05)
""")


def _clean_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "SLURM_JOB_ID", "EAGLE3_NUM_GPUS")}
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "src"), env.get("PYTHONPATH", "")])
    return env


def test_gpu_device_locks_with_real_devices(tmp_path, model_dir, selection):
    from eagle3_data import devices

    env = _clean_env()
    pool, source = devices.visible_pool(env)
    assert source == "nvidia-smi" and len(pool) == torch.cuda.device_count() >= 1
    n = len(pool)
    locks, release = tmp_path / "locks", tmp_path / "release"
    script = tmp_path / "holder.py"
    script.write_text(HOLDER)
    holder = subprocess.Popen(
        [sys.executable, str(script), str(n), str(locks), str(release)], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        held = json.loads(holder.stdout.readline())
        # the holder has every device, sees exactly those, and ran a kernel on one
        assert held["dev"] == "cuda" and sorted(held["ids"]) == sorted(pool) and held["count"] == n
        assert held["cvd"] == ",".join(held["ids"]) and held["x"] == 4.0
        # a second job needing one device waits (here: times out) while they are all held ...
        probe = (
            "import sys\nfrom eagle3_data.devices import gpu_devices\n"
            f"try:\n with gpu_devices(1, lock_dir={str(locks)!r}, timeout_s=1.0, poll_s=0.05): print('got')\n"
            "except TimeoutError: print('timeout')"
        )
        t0 = time.monotonic()
        out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
        assert out.stdout.strip() == "timeout", out.stderr[-2000:]
        assert time.monotonic() - t0 < 60
    finally:
        release.touch()
        holder.wait(timeout=60)
    # ... and gets one as soon as they are released: a whole extraction on one locked device
    code = (
        "import json, sys\nfrom eagle3_data.extract import extract_states\n"
        "from eagle3_data.settings import ExtractSettings\n"
        f"info = extract_states({str(selection)!r}, {str(tmp_path / 'x.safetensors')!r}, "
        f"settings=ExtractSettings.defaults({str(model_dir)!r}, layers={LAYERS}, dtype='bfloat16', "
        f"device='cuda', gpus_per_job=1, gpu_lock_dir={str(locks)!r}))\nprint(json.dumps(info))"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    info = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(info["devices"]) == 1 and info["devices"][0] in pool and info["device"].startswith("cuda")
    assert info["attention"] == "packed:varlen" and info["num_tokens"] == sum(LENGTHS)


def test_gpu_packed_forward_computes_no_padding(model_dir, bf16):
    """The packed forward's input is exactly the real tokens (one row), and its attention ran once per layer."""
    seen = []
    h = bf16[1].register_forward_pre_hook(lambda m, a, kw: seen.append(tuple(kw["input_ids"].shape)), with_kwargs=True)
    be = tb.TransformersBackend(model_dir, layers=LAYERS, dtype="bfloat16", loaded=bf16, attention="packed")
    try:
        out = be.capture([np.arange(n) % V for n in (1, 700, 5)])
    finally:
        be.close()
        h.remove()
    assert seen == [(1, 706)] and [a.shape[0] for a, _ in out] == [1, 700, 5]
