"""Bytes per token on disk: the hidden states in each storage choice and every export layout, at H = 4,096.

    python benchmarks/capture_bytes.py            # 8 samples x 1,024 tokens of an 8B config (35 s, 3.3 GB in a temp folder)
    python benchmarks/capture_bytes.py --toy      # seconds: 2 samples x 96 tokens, the same code (what CI runs)

An 8B target's shapes (Llama-3.1-8B: 32 layers, H = 4,096) without its weights: the extract stage's own writer
(``HiddenStateWriter``, what every extract job uses) is fed random bfloat16 states of the right shapes (a normal
distribution with a few outlier channels 50x larger, as real residual streams have), then the export stage's own
code (``eagle3_data.export.export``) writes every layout from those files, and the bytes on disk are divided by the
tokens. Per-file headers are included (with ``--length`` tokens per sample).

The baseline, measured in the same run: SpecForge's own bf16 offline layout, written as its
``scripts/prepare_hidden_states.py`` writes a sample (``torch.save`` of ``input_ids``, ``loss_mask`` int64,
``hidden_state`` [1, T, H] and ``aux_hidden_state`` [1, T, 3H] bfloat16). The plan's formula for each figure
(``eagle3_data.plan.bytes_per_token`` / ``export_bytes_per_token``) is printed beside it.

Target (the last JSON line): EAGLE-3 states in the FP8 choice (``extract.aux_format`` and ``extract.final_format``
``fp8_e4m3``) at most 16,500 bytes per token (speculators' FP8 connector files: 16,396).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

#: Llama-3.1-8B's shape (config.json): the layers and hidden size are all the writer and the exports use
TARGET = {"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096, "vocab_size": 128256}
TARGET_EAGLE3_FP8 = 16_500

#: storage choices: name -> (drafters, extract settings)
CHOICES = {
    "eagle3 bf16": (["eagle3"], {}),
    "eagle3 fp8 (aux + final)": (["eagle3"], {"aux_format": "fp8_e4m3", "final_format": "fp8_e4m3"}),
    "eagle3 fp8 aux + supervised fp8 final": (
        ["eagle3"],
        {"aux_format": "fp8_e4m3", "final_format": "fp8_e4m3", "final_states": "supervised"},
    ),
    "eagle3+dflash+dspark bf16": (["eagle3", "dflash", "dspark"], {}),
    "eagle3+dflash+dspark fp8 (aux + final)": (
        ["eagle3", "dflash", "dspark"],
        {"aux_format": "fp8_e4m3", "final_format": "fp8_e4m3"},
    ),
}


def make_selection(path: Path, samples: int, length: int, seed: int = 0) -> list[dict]:
    """A MERGED parquet of ``samples`` samples of ``length`` tokens: a third prompt, the rest supervised."""
    import numpy as np

    from eagle3_data import schemas

    rng = np.random.default_rng(seed)
    p = length // 3
    rows = [
        {
            "sample_id": f"s{i}",
            "dataset": "bench",
            "input_ids": rng.integers(0, 128_000, length).tolist(),
            "loss_mask": [0] * p + [1] * (length - p),
            "num_tokens": length,
            "num_supervised": length - p,
            "truncated": False,
            "source": "bench/000",
        }
        for i in range(samples)
    ]
    schemas.write_checked(schemas.from_rows(rows, schemas.MERGED), "merged", path)
    return rows


def random_states(n: int, width: int, seed: int):
    """[n, width] bfloat16: N(0, 1) with every 97th channel 50x larger (outliers, as in real residual streams)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, width, generator=g)
    x[:, ::97] *= 50.0
    return x.to(torch.bfloat16)


def write_states(sel: Path, out: Path, drafters: list, savers: dict, seed: int) -> dict:
    """The extract stage's file for ``sel`` with random states, through ``HiddenStateWriter`` (the metadata an
    extract job writes, ``final_norm: both`` with an RMSNorm weight)."""
    import torch

    from eagle3_data.extract import HiddenStateWriter, TokenShard, resolve_drafter_layers

    shard = TokenShard(sel)
    H, L = TARGET["hidden_size"], TARGET["num_hidden_layers"]
    union, per = resolve_drafter_layers(drafters, None, None, L)
    meta = {
        "backend": "transformers",
        "model_path": "<8B config>",
        "model_name": "llama-8b",
        "model_type": "llama",
        "model_fingerprint": "bench",
        "num_layers": str(L),
        "layers": json.dumps(union),
        "drafter_layers": json.dumps(per),
        "layer_convention": "output of 0-based decoder layer i",
        "final_norm": "both",
        "norm_formula": "llama",
        "norm_eps": "1e-05",
        "norm_check": "{}",
        "sample_ids": json.dumps(shard.sample_ids),
        "datasets": json.dumps(shard.datasets),
        "source": str(sel),
        "selection_digest": "bench",
        "state_settings": "bench",
    }
    w = HiddenStateWriter(
        out,
        shard,
        hidden_size=H,
        num_aux=len(union),
        dtype="bfloat16",
        final_states=savers.get("final_states", "all"),
        aux_format=savers.get("aux_format", "same"),
        final_format=savers.get("final_format", "same"),
        metadata=meta,
        norm_weight=torch.ones(H),
    )
    with w:
        for i in range(shard.n):
            n = shard.lengths[i]
            w.write(i, random_states(n, len(union) * H, seed + i), random_states(n, H, seed + 1000 + i))
    return {"bytes": os.path.getsize(out), "layers": union, "tokens": shard.T}


def specforge_baseline(states: Path, rows: list, out: Path) -> int:
    """SpecForge's own bf16 offline layout (prepare_hidden_states.py's ``torch.save`` per sample) of the same
    tensors; returns the bytes written."""
    import torch

    from eagle3_data.extract import StatesFile

    total = 0
    out.mkdir(parents=True, exist_ok=True)
    with StatesFile(states) as sf:
        for i, r in enumerate(rows):
            t = sf.sample(sf.index[r["sample_id"]], final="post", layers=sf.drafter_layers["eagle3"])
            path = out / f"data_{i}.ckpt"
            torch.save(
                {
                    "input_ids": t["input_ids"],
                    "loss_mask": t["loss_mask"],
                    "hidden_state": t["hidden_states"].unsqueeze(0),
                    "aux_hidden_state": t["aux_hidden_states"].unsqueeze(0),
                },
                str(path),
            )
            total += os.path.getsize(path)
    return total


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--toy", action="store_true", help="2 samples x 96 tokens (seconds)")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--length", type=int, default=1024, help="tokens per sample")
    ap.add_argument("--keep", type=Path, default=None, help="write here and keep the files (default: a temp dir)")
    a = ap.parse_args(argv)
    if a.toy:
        a.samples, a.length = 2, 96
    from eagle3_data import export as exp
    from eagle3_data import plan as pl
    from eagle3_data.settings import ExportSettings

    H = TARGET["hidden_size"]
    t0 = time.perf_counter()
    tmp = a.keep or Path(tempfile.mkdtemp(prefix="capture-bytes-"))
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        sel = tmp / "selection.parquet"
        rows = make_selection(sel, a.samples, a.length)
        T = sum(r["num_tokens"] for r in rows)
        states, files = {}, {}
        for k, (name, (drafters, savers)) in enumerate(CHOICES.items()):
            files[name] = tmp / f"states-{k}" / "bench" / "000.safetensors"
            files[name].parent.mkdir(parents=True)
            info = write_states(sel, files[name], drafters, savers, seed=0)
            share = None
            if savers.get("final_states") == "supervised":
                from eagle3_data.extract import StatesFile

                with StatesFile(files[name]) as sf:
                    share = float(sf.frow[-1]) / T
            formula = pl.bytes_per_token(
                H,
                len(info["layers"]),
                dtype="bfloat16",
                aux_format=savers.get("aux_format", "same"),
                final_format=savers.get("final_format", "same"),
                final=savers.get("final_states", "all"),
                final_share=share or 1.0,
            )
            states[name] = {
                "bytes_per_token": round(info["bytes"] / T, 1),
                "plan_formula": formula["total"],
                "layers": len(info["layers"]),
            }
        # every layout from the union's bf16 states (one extraction for all), speculators_fp8 also from fp8 ones
        union = files["eagle3+dflash+dspark bf16"]
        merged = tmp / "merged.parquet"
        shutil.copy(sel, merged)
        manifest = {"shards": [{"samples": len(rows)}], "selections": {"bench/000": {"digest": "bench"}}}
        exports = {}
        for layout in exp.LAYOUTS:
            m = exp.export(
                merged,
                tmp / "export" / layout,
                layout=layout,
                states_dir=union.parent.parent,
                merge_manifest=manifest,
                settings=ExportSettings.defaults(),
            )
            exports[layout] = {
                "bytes_per_token": round(m["bytes"] / T, 1),
                "plan_formula": pl.export_bytes_per_token(layout, H)["total"],
            }
        m = exp.export(
            merged,
            tmp / "export" / "speculators_fp8-from-fp8",
            layout="speculators_fp8",
            states_dir=files["eagle3+dflash+dspark fp8 (aux + final)"].parent.parent,
            merge_manifest=manifest,
            settings=ExportSettings.defaults(),
        )
        exports["speculators_fp8 (from fp8 states)"] = {
            "bytes_per_token": round(m["bytes"] / T, 1),
            "plan_formula": pl.export_bytes_per_token("speculators_fp8", H)["total"],
        }
        baseline = specforge_baseline(union, rows, tmp / "baseline-specforge") / T
    finally:
        if a.keep is None:
            shutil.rmtree(tmp, ignore_errors=True)
    fp8 = states["eagle3 fp8 (aux + final)"]["bytes_per_token"]
    out = {
        "benchmark": "capture_bytes",
        "toy": a.toy,
        "hidden_size": H,
        "num_layers": TARGET["num_hidden_layers"],
        "samples": a.samples,
        "tokens_per_sample": a.length,
        "tokens": T,
        "states_bytes_per_token": states,
        "exports_bytes_per_token": exports,
        "baseline_specforge_bf16_bytes_per_token": round(baseline, 1),
        "eagle3_fp8_states_bytes_per_token": fp8,
        "ratio_eagle3_fp8_states_vs_baseline": round(fp8 / baseline, 4),
        "ratio_eagle3_bf16_states_vs_baseline": round(states["eagle3 bf16"]["bytes_per_token"] / baseline, 4),
        "ratio_specforge_export_vs_baseline": round(exports["specforge"]["bytes_per_token"] / baseline, 4),
        "ratio_speculators_fp8_vs_speculators": round(
            exports["speculators_fp8"]["bytes_per_token"] / exports["speculators"]["bytes_per_token"], 4
        ),
        "target_eagle3_fp8_states_le": TARGET_EAGLE3_FP8,
        "met": fp8 <= TARGET_EAGLE3_FP8,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
