"""Fused elementwise kernels of the extraction forward (eagle3_data.extract.fused): fused only where they
reproduce the module, states unchanged, undone on close."""

from __future__ import annotations

import types

import pytest
import torch

from eagle3_data.testing.workflow import save_tiny_llama
from eagle3_data import extract as ex
from eagle3_data import schemas
from eagle3_data.extract.fused import fuse_elementwise, unfuse
from eagle3_data.extract.layout import load_states
from eagle3_data.extract.transformers_backend import load_target
from eagle3_data.settings import ExtractSettings


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_llama(
        tmp_path_factory.mktemp("fused") / "tiny", hidden_size=64, num_layers=4, vocab_size=300, seed=3
    )


def _states(decoder, ids):
    with torch.inference_mode():
        return decoder(input_ids=ids, output_hidden_states=True).hidden_states


def test_fused_kernels_reproduce_the_eager_states_and_come_undone(tiny):
    model, decoder = load_target(tiny, dtype="bfloat16", device="cpu")
    ids = torch.randint(0, 300, (1, 40), generator=torch.Generator().manual_seed(0))
    ref = _states(decoder, ids)
    assert fuse_elementwise(decoder, "auto") == {"norms": 0, "mlps": 0, "skipped": ["fused: auto on cpu"]}
    info = fuse_elementwise(decoder, "on")
    assert info == {"norms": 2 * 4 + 1, "mlps": 4, "skipped": []}
    assert all("forward" in layer.mlp.__dict__ for layer in decoder.layers)
    got = _states(decoder, ids)
    # the compiled kernels keep eager's casts (emulate_precision_casts): the same bits, layer after layer
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    unfuse(decoder)
    assert not any("forward" in m.__dict__ for m in decoder.modules())  # (none had one of its own before)
    assert all(torch.equal(a, b) for a, b in zip(ref, _states(decoder, ids)))


def test_a_module_of_another_formula_is_left_alone(tiny):
    model, decoder = load_target(tiny, dtype="bfloat16", device="cpu")

    def gemma_norm(self, x):  # (1 + weight), as Gemma's RMSNorm
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (h * (1.0 + self.weight.float())).to(x.dtype)

    def gelu_mlp(self, x):
        return self.down_proj(torch.nn.functional.gelu(self.gate_proj(x)) * self.up_proj(x))

    decoder.norm.forward = types.MethodType(gemma_norm, decoder.norm)
    decoder.layers[0].mlp.forward = types.MethodType(gelu_mlp, decoder.layers[0].mlp)
    info = fuse_elementwise(decoder, "on")
    assert info["norms"] == 8 and info["mlps"] == 3
    assert sorted(info["skipped"]) == ["LlamaMLP: another activation", "LlamaRMSNorm: another formula"]
    assert decoder.norm.forward.__func__ is gemma_norm  # still its own
    with pytest.raises(ValueError, match="extract.fused"):
        fuse_elementwise(decoder, "yes")


def test_extraction_with_fused_kernels_writes_the_same_file(tiny, tmp_path):
    rows = []
    g = torch.Generator().manual_seed(1)
    for i, n in enumerate([7, 19, 33]):
        ids = torch.randint(0, 300, (n,), generator=g).tolist()
        mask = [0] * (n // 2) + [1] * (n - n // 2)
        rows.append(
            {
                "sample_id": f"s{i}",
                "dataset": "d",
                "input_ids": ids,
                "loss_mask": mask,
                "num_tokens": n,
                "num_supervised": sum(mask),
                "truncated": False,
                "source": "d/000",
            }
        )
    sel = tmp_path / "sel.parquet"
    schemas.write_checked(schemas.from_rows(rows, schemas.MERGED), "merged", sel)
    loaded = load_target(tiny, dtype="bfloat16", device="cpu")
    out = {}
    for mode in ("off", "on"):
        settings = ExtractSettings.defaults(model_path=str(tiny), dtype="bfloat16", fused=mode, attention="packed")
        info = ex.extract_states(sel, tmp_path / f"{mode}.safetensors", settings=settings, model=loaded)
        out[mode] = load_states(tmp_path / f"{mode}.safetensors")[0]
        assert info["fused"]["norms"] == (9 if mode == "on" else 0)
    for key in ("aux_hidden_states", "hidden_states"):
        assert torch.equal(out["on"][key], out["off"][key])
    assert not any("forward" in m.__dict__ for m in loaded[1].modules())  # the caller's model is given back
