"""The SGLang backend on a GPU with sglang installed (the GPU env, envs/sglang-gpu.txt): its file against the
transformers backend's, and its auxiliary states against SGLang's public engine API, on a tiny random target.

Skipped without CUDA or sglang. Each extraction runs in its own process, as a workflow job does (SGLang's rank
set-up is process-global)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

LAYERS = [4, 1, 3]  # unsorted: SGLang returns ascending blocks, the file keeps this order


def _needs_gpu_and_sglang():
    import torch

    from eagle3_data.extract import sglang_backend as sx

    if not torch.cuda.is_available() or not sx.sglang_available():
        pytest.skip("needs a CUDA device and sglang (envs/sglang-gpu.txt)")


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    _needs_gpu_and_sglang()
    from eagle3_data.settings import TinyTargetSettings
    from eagle3_data.tiny_target import build_tiny_target

    path = tmp_path_factory.mktemp("tiny") / "tiny-target"
    # head_dim 64: a size every SGLang attention backend supports
    info = build_tiny_target(
        path,
        settings=TinyTargetSettings.defaults(
            seed=3,
            hidden_size=256,
            num_layers=8,
            num_heads=4,
            num_kv_heads=2,
            intermediate_size=512,
            max_position_embeddings=4096,
        ),
    )
    return path, info


@pytest.fixture(scope="module")
def selection(tmp_path_factory, target):
    from eagle3_data import schemas

    _, info = target
    rng = random.Random(11)
    rows = []
    for i in range(40):  # more samples than one forward's request cap below, several lengths
        n = rng.choice([5, 17, 64, 300])
        p = rng.randint(1, n - 1)
        rows.append(
            {
                "sample_id": f"s{i}",
                "dataset": "d",
                "input_ids": [rng.randrange(256) for _ in range(n)],
                "loss_mask": [0] * p + [1] * (n - p),
                "num_tokens": n,
                "num_supervised": n - p,
                "truncated": False,
            }
        )
    path = tmp_path_factory.mktemp("sel") / "000.parquet"
    schemas.write_checked(schemas.from_rows(rows, schemas.MERGED), "merged", path)
    return path, rows


def _run(code: str) -> None:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]


def _extract(selection, out, model, backend):
    _run(f"""
        from eagle3_data import extract as ex
        from eagle3_data.settings import ExtractSettings
        ex.extract_states({str(selection)!r}, {str(out)!r}, settings=ExtractSettings.defaults(
            {str(model)!r}, layers={LAYERS!r}, dtype="bfloat16", device="cuda", gpus_per_job=1, backend={backend!r},
            batch_tokens=2048, final_norm="post"))
    """)


def test_sglang_file_matches_the_transformers_file(tmp_path, target, selection):
    import torch

    from eagle3_data import extract as ex

    model, _ = target
    sel, rows = selection
    ref, out = tmp_path / "hf.safetensors", tmp_path / "sg.safetensors"
    _extract(sel, ref, model, "transformers")
    _extract(sel, out, model, "sglang")
    ta, ma = ex.read_hidden_states(ref)
    tb, mb = ex.read_hidden_states(out)
    assert mb["backend"] == "sglang" and json.loads(mb["layers"]) == LAYERS == json.loads(ma["layers"])
    assert torch.equal(ta["input_ids"], tb["input_ids"]) and tb["input_ids"].numel() == sum(
        len(r["input_ids"]) for r in rows
    )
    for k in ("aux_hidden_states", "hidden_states"):
        a, b = ta[k].float(), tb[k].float()
        assert a.shape == b.shape, k
        # blockwise: a swapped layer block would have a low similarity
        for blk in range(a.shape[1] // 256):
            cols = slice(256 * blk, 256 * (blk + 1))
            cos = torch.nn.functional.cosine_similarity(a[:, cols], b[:, cols], dim=-1)
            assert cos.min() > 0.98, (k, blk, cos.min())


def test_sglang_aux_states_match_the_public_engine_api(tmp_path, target, selection):
    import torch

    from eagle3_data import extract as ex
    from eagle3_data.extract import sglang_backend as sx

    model, _ = target
    sel, rows = selection
    few = rows[:4]
    out = tmp_path / "sg.safetensors"
    _extract(sel, out, model, "sglang")
    ids = sx.sglang_layer_ids(LAYERS, num_layers=8, architecture="LlamaForCausalLM")
    npz = tmp_path / "engine.npz"
    _run(f"""
        import numpy as np, sglang
        eng = sglang.Engine(model_path={str(model)!r}, skip_tokenizer_init=True, dtype="bfloat16",
                            enable_return_aux_hidden_states=True, speculative_algorithm="EAGLE3",
                            return_aux_hidden_state_layer_ids={ids!r}, disable_radix_cache=True,
                            mem_fraction_static=0.5)
        try:
            res = eng.generate(input_ids={[r["input_ids"] for r in few]!r},
                               sampling_params={{"max_new_tokens": 1, "temperature": 0}}, return_hidden_states=True)
            np.savez({str(npz)!r}, *[np.asarray(r["meta_info"]["hidden_states"][0], dtype=np.float32) for r in res])
        finally:
            eng.shutdown()
    """)
    engine = np.load(npz)
    tb, _ = ex.read_hidden_states(out)
    order = sx.column_order(LAYERS)  # the file's block k is the engine's (ascending) block order[k]
    offsets = np.concatenate([[0], np.cumsum([len(r["input_ids"]) for r in rows])])
    for k, r in enumerate(few):
        n = len(r["input_ids"])
        eng = torch.from_numpy(engine[f"arr_{k}"]).reshape(n, len(LAYERS), 256)[:, order, :].reshape(n, -1)
        mine = tb["aux_hidden_states"][offsets[k] : offsets[k] + n].float()
        cos = torch.nn.functional.cosine_similarity(eng, mine, dim=-1)
        assert cos.min() > 0.99, (r["sample_id"], cos.min())
