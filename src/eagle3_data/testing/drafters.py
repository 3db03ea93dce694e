"""EAGLE-3 drafters trained and scored with speculators' own code on a speculators data directory (the
``speculators`` / ``speculators_fp8`` exports): what ``benchmarks/draft_quality.py`` runs.

The drafter is speculators 0.9.0's ``Eagle3DraftModel`` (its train command's eagle3 defaults), trained with its
eager KL loss and ``shift_batch``, its ``build_optimizers`` (Muon on the 2D weights and AdamW on the rest) and its
Trainer's schedule and precision (``speculators/train/trainer.py``). Data is read by speculators' ``ArrowDataset``,
through hs_connectors' ``FP8Transfer`` for an FP8 export (``transfer="fp8"``), as ``--hidden-states-backend fp8``
reads it. A training run is a list of batches fixed in advance (:func:`batch_plan`), so two drafters can be given
the same batches, or the same number of supervised tokens (:func:`steps_for_supervised`).
"""

from __future__ import annotations

import contextlib
import os
import random
import time
from pathlib import Path

#: drafters training now in this run's worker processes (a shared counter set by :func:`train_drafters`), so each
#: takes its share of the cores, and the last ones left take the cores the finished ones freed
_RUNNING = None

__all__ = [
    "samples_table",
    "shared_prompts",
    "supervised_counts",
    "target_agreement",
    "pack",
    "batch_plan",
    "steps_for_supervised",
    "new_drafter",
    "train",
    "score",
    "drafter_run",
    "train_drafters",
]


def samples_table(data_dir: Path) -> list[dict]:
    """The export's samples (``index``, ``sample_id``, ``dataset``, ``seq_len``) in global index order."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    parts = sorted(Path(data_dir).glob("samples_*.parquet"))
    t = pa.concat_tables([pq.read_table(p, columns=["index", "sample_id", "dataset", "seq_len"]) for p in parts])
    return sorted(t.to_pylist(), key=lambda r: r["index"])


def shared_prompts(work: Path, train_rows: list[dict], held_rows: list[dict]) -> dict:
    """The held-out split against training by prompt text: each row's user texts (its dataset's
    ``results/<ds>/prompts/*.parquet`` row, by sample id less a trailing ``@<turn>``), case, punctuation and
    spacing ignored (:func:`eagle3_data.decontaminate.overlap.normalized`). Returns ``{"training_prompts",
    "heldout_prompts", "shared", "example"}``: distinct normalized prompts on each side, how many are on both,
    one of them (None when none). A row whose prompt can't be found raises ``SystemExit``."""
    import json
    import re

    import pyarrow.parquet as pq

    from eagle3_data.decontaminate.overlap import normalized

    texts: dict[tuple[str, str], str] = {}
    for ds in {r["dataset"] for r in train_rows + held_rows}:
        for p in sorted((Path(work) / "results" / ds / "prompts").glob("*.parquet")):
            for r in pq.read_table(p, columns=["sample_id", "messages"]).to_pylist():
                users = [m["content"] for m in json.loads(r["messages"]) if m.get("role") == "user"]
                texts[ds, r["sample_id"]] = "\n".join(normalized(t) for t in users)

    def side(rows: list[dict]) -> set[str]:
        out = set()
        for r in rows:
            key = (r["dataset"], re.sub(r"@[0-9]+$", "", r["sample_id"]))
            if key not in texts:
                raise SystemExit(f"no prompt found for {key[0]}/{key[1]} under {work}/results/{key[0]}/prompts/")
            out.add(texts[key])
        return out

    train, held = side(train_rows), side(held_rows)
    both = sorted(train & held)
    return {
        "training_prompts": len(train),
        "heldout_prompts": len(held),
        "shared": len(both),
        "example": both[0][:200] if both else None,
    }


def supervised_counts(data_dir: Path, max_len: int) -> list[int]:
    """Per row of the data directory's ``datasets`` table: the supervised tokens (``loss_mask`` 1) among its first
    ``max_len`` tokens, what a training batch cut at ``max_len`` holds of it."""
    from datasets import load_from_disk

    return [sum(m[:max_len]) for m in load_from_disk(str(data_dir))["loss_mask"]]


def _dataset(data_dir: Path, max_len: int, precision: str, transfer: str | None):
    from speculators.train.data import ArrowDataset

    hs = None
    if transfer == "fp8":
        from hs_connectors import FP8Transfer

        hs = FP8Transfer(Path(data_dir) / "hidden_states", dequantize_dtype=_dtype(precision))
    elif transfer is not None:
        raise ValueError(f"transfer: 'fp8' or None, got {transfer!r}")
    return ArrowDataset(
        max_len=max_len, datapath=str(data_dir), transfer=hs, on_missing="raise", hidden_states_dtype=_dtype(precision)
    )


def target_agreement(data_dir: Path, target_dir: Path, max_len: int) -> dict[str, dict]:
    """Per dataset of a speculators data directory: the share of supervised positions whose next token is the
    target's argmax, the target's own final norm and head applied to the stored final states (this layout stores
    them before the norm). The target's greedy replies score near 1 (rounding apart); the datasets' own answers
    score what the target would have said; a loss mask or target row shifted by one token would score near 0."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32, local_files_only=True)
    norm, head = model.get_decoder().norm, model.get_output_embeddings()
    ds = _dataset(data_dir, max_len, "float32", None)
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


def batch_plan(indices: list[int], lengths: dict[int, int], max_len: int, seed: int, steps: int) -> list[list[int]]:
    """The ``steps`` batches a training run draws: epochs of ``indices`` shuffled with ``seed`` (one
    ``random.Random(seed)`` for the run), each packed by :func:`pack`."""
    rng, queue, out = random.Random(seed), [], []
    while len(out) < steps:
        if not queue:
            order = list(indices)
            rng.shuffle(order)
            queue = pack(order, lengths, max_len)
        out.append(queue.pop(0))
    return out


def steps_for_supervised(
    indices: list[int], lengths: dict[int, int], supervised: dict[int, int], max_len: int, seed: int, budget: int
) -> int:
    """The fewest steps whose :func:`batch_plan` holds at least ``budget`` supervised tokens (``supervised``: per
    index, as :func:`supervised_counts`). Raises ValueError when no index has a supervised token."""
    if not any(supervised[i] for i in indices):
        raise ValueError("no supervised token in these rows")
    rng, queue, steps, seen = random.Random(seed), [], 0, 0
    while seen < budget:
        if not queue:
            order = list(indices)
            rng.shuffle(order)
            queue = pack(order, lengths, max_len)
        seen += sum(supervised[i] for i in queue.pop(0))
        steps += 1
    return steps


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
    batches: list[list[int]],
    *,
    max_len: int,
    lr: float,
    ttt_steps: int,
    precision: str = "bfloat16",
    optimizer: str = "muon",
    transfer: str | None = None,
) -> dict:
    """One optimizer step per batch of ``batches`` (indices of the data directory, :func:`batch_plan`), each cut
    to ``max_len`` tokens, at speculators' train defaults: its ``build_optimizers`` (``optimizer`` "muon":
    ``torch.optim.Muon`` on the 2D weights, AdamW on the rest; or "adamw"), ``lr`` for both groups and the
    ``TrainerConfig`` defaults for the rest (weight decay 0.01 for AdamW, 0.1 for Muon), a linear schedule with 1%
    warm-up decaying to 0 at the last step (``speculators/train/trainer.py``), the gradient norm clipped at 1.0;
    the states read (through ``transfer``) and the forward run at ``precision`` (its Trainer: bfloat16 states, a
    bfloat16 autocast, float32 weights and optimizer). Returns loss and token counts and the learning rate of the
    first group at its peak and at the last step."""
    import torch
    from speculators.losses import resolve_loss_config
    from speculators.train.optimizers import build_optimizers
    from speculators.train.trainer import TrainerConfig
    from transformers import get_linear_schedule_with_warmup

    steps = len(batches)
    ds = _dataset(data_dir, max_len, precision, transfer)
    hidden = model.config.transformer_layer_config.hidden_size
    params = [p for p in model.parameters() if p.requires_grad]
    config = TrainerConfig(lr=lr, muon_lr=lr, num_epochs=1, save_path="", optimizer=optimizer)
    opts = build_optimizers(model, config)
    scheds = [get_linear_schedule_with_warmup(o, num_warmup_steps=steps // 100, num_training_steps=steps) for o in opts]
    loss_config = resolve_loss_config("kl_div", implementation="eager")
    losses, lrs, supervised = [], [], 0
    model.train()
    for idx in batches:
        _share_cores()
        b = _batch(ds, idx, max_len, hidden)
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
        supervised += int(b["loss_mask"].sum())
    return {
        "steps": steps,
        "tokens": steps * max_len,
        "supervised_tokens": supervised,
        "loss_first": round(sum(losses[:5]) / min(5, len(losses)), 4),
        "loss_last": round(sum(losses[-5:]) / min(5, len(losses)), 4),
        "lr_peak": max(lrs),
        "lr_last_step": lrs[-1],
    }


def _share_cores() -> None:
    """Intra-op threads: this process's share of the cores among the drafters training now (see :data:`_RUNNING`)."""
    if _RUNNING is not None:
        import torch

        want = max(1, (os.cpu_count() or 1) // max(1, _RUNNING.value))
        if torch.get_num_threads() != want:
            torch.set_num_threads(want)


def _init_worker(running) -> None:
    global _RUNNING
    _RUNNING = running


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
    over all of them (counts summed before dividing), at ``precision`` (as :func:`train`). ``acc_k`` is the share
    of supervised positions whose first ``k + 1`` drafted tokens all equal the target's argmax (speculators'
    ``full_acc`` counts, the drafter feeding itself its own states as at inference).

    Beside it, ``tau_walk``: the same drafts read at the positions an engine drafts from (:func:`_walk`), where
    ``tau`` weighs every position alike."""
    import torch
    from speculators.losses import resolve_loss_config

    ds = _dataset(data_dir, max_len, precision, None)
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
                drafts, _, metrics = _forward(model, b, ttt_steps, loss_config, precision)
                walked = _walk(model, b, drafts, precision)
            for k in range(ttt_steps):
                for part in ("sum", "total"):
                    key = f"full_acc_{k}_{part}"
                    counts[key] = counts.get(key, 0.0) + float(metrics[key])
                    total[key] = total.get(key, 0.0) + float(metrics[key])
            for key, value in zip(("walk_drafts", "walk_accepted"), walked):
                counts[key] = counts.get(key, 0) + value
                total[key] = total.get(key, 0) + value
        out[name] = _summary(counts, ttt_steps, len(idx))
    out["overall"] = _summary(total, ttt_steps, sum(len(v) for v in groups.values()))
    return out


def _summary(counts: dict, ttt_steps: int, samples: int) -> dict:
    acc = [
        counts[f"full_acc_{k}_sum"] / counts[f"full_acc_{k}_total"] if counts.get(f"full_acc_{k}_total") else 0.0
        for k in range(ttt_steps)
    ]
    drafts = counts.get("walk_drafts", 0)
    return {
        "samples": samples,
        "positions": int(counts.get("full_acc_0_total", 0)),
        "acc": [round(a, 6) for a in acc],
        "tau": round(1 + sum(acc), 6),
        "tau_walk": round(1 + counts.get("walk_accepted", 0) / drafts, 6) if drafts else 1.0,
        "walk_drafts": drafts,
    }


def _walk(model, b, drafts: list, precision: str) -> tuple[int, int]:
    """:func:`walk` of a scored batch ``b`` (after ``shift_batch``) and its drafts (one [1, T] tensor of draft-vocab
    ids per speculative step), the target's argmax from the batch's final states."""
    import torch

    with torch.autocast("cpu", dtype=_dtype(precision), enabled=precision != "float32"):
        target = model.verifier_lm_head(model.verifier_norm(b["verifier_last_hidden_states"])).argmax(-1)[0]
    mask, docs = b["loss_mask"][0].bool(), b["document_ids"][0]
    return walk(accepted_prefix([d[0] for d in drafts], target, mask, docs), mask, docs)


def accepted_prefix(drafts: list, target, mask, docs):
    """Per draft start ``t`` (a [T] int64 tensor): how many of the drafted tokens ``drafts[k][t]`` (the token drafted
    ``k`` steps after ``t``, [T] each) equal ``target[t + k]`` in a row, each inside the loss ``mask`` and the same
    document (``docs``) as ``t``, and ``t`` itself supervised: speculators' ``full_acc`` per position."""
    import torch

    T = target.shape[0]
    accepted = torch.zeros(T, dtype=torch.long)
    alive = mask.bool().clone()
    for k, drafted in enumerate(drafts):
        ok = torch.zeros(T, dtype=torch.bool)
        ok[: T - k] = (drafted[: T - k] == target[k:]) & mask[k:].bool() & (docs[k:] == docs[: T - k])
        alive &= ok
        accepted += alive.long()
    return accepted


def walk(accepted, mask, docs) -> tuple[int, int]:
    """The verify loop of speculative decoding replayed on teacher-forced drafts: per document, from its second
    supervised position (an engine's first draft follows the target's first token) to its last, draft at ``t``,
    accept ``accepted[t]`` tokens (:func:`accepted_prefix`), move to ``t + accepted[t] + 1``. Returns (drafts,
    accepted tokens). An engine drafts only where the last verify step stopped: it crosses a run of easy positions
    in a few drafts and drafts at every token of a hard one, so its acceptance length is below ``tau``, the
    average over every position."""
    import torch

    n_drafts = n_accepted = 0
    for doc in torch.unique(docs).tolist():
        sup = torch.nonzero(mask.bool() & (docs == doc)).flatten().tolist()
        t, last = (sup[0] + 1, sup[-1]) if sup else (0, -1)
        while t <= last:
            n_drafts += 1
            n_accepted += int(accepted[t])
            t += int(accepted[t]) + 1
    return n_drafts, n_accepted


def drafter_run(
    *,
    target_dir: Path,
    vocab: Path,
    data_dir: Path,
    batches: list[list[int]],
    held_dir: Path,
    groups: dict[str, dict[str, list[int]]],
    max_len: int,
    seed: int,
    lr: float,
    ttt_steps: int,
    threads: int,
    save_dir: Path | None = None,
    precision: str = "bfloat16",
    optimizer: str = "muon",
    transfer: str | None = None,
) -> tuple[dict, float]:
    """One drafter: built from ``seed``, trained on ``batches`` of ``data_dir`` (read through ``transfer``),
    scored on each split of ``groups`` (split name -> domain -> held-out indices of ``held_dir``), with ``threads``
    intra-op threads, and saved in speculators' format to ``save_dir`` (``save_pretrained``: what vLLM loads as an
    EAGLE-3 speculator). Returns its result and its wall seconds."""
    import torch

    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    with _counted():
        model = new_drafter(target_dir, vocab, seed)
        kw = dict(max_len=max_len, lr=lr, ttt_steps=ttt_steps, precision=precision, optimizer=optimizer)
        fit = train(model, data_dir, batches, transfer=transfer, **kw)
    res = {"train_samples": len({i for b in batches for i in b}), "training": fit}
    for split, idx in groups.items():
        res[split] = score(model, held_dir, idx, max_len=max_len, ttt_steps=ttt_steps, precision=precision)
    if save_dir is not None:
        model.save_pretrained(str(save_dir))
        res["saved"] = str(save_dir)
    return res, round(time.perf_counter() - t0, 1)


@contextlib.contextmanager
def _counted():
    """Count this process among the drafters training now (:data:`_RUNNING`) for the block."""
    if _RUNNING is None:
        yield
        return
    with _RUNNING.get_lock():
        _RUNNING.value += 1
    try:
        yield
    finally:
        with _RUNNING.get_lock():
            _RUNNING.value -= 1


def train_drafters(jobs: dict[tuple[str, int], dict], *, workers: int) -> tuple[dict, dict]:
    """Run each of ``jobs`` ((name, seed) -> :func:`drafter_run` keywords) in a process of its own, ``workers`` at
    once, the CPU cores shared out among the drafters training at each step (one drafter's step on 2 threads is
    1.7x, not 2x, its step on one: one-thread drafters side by side train faster than one after the other; the last
    one left takes every core). The same seed, data and steps give the same drafter up to the order of float sums,
    which the thread count changes. Returns (results, wall seconds) by the jobs' keys."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    cores = os.cpu_count() or 1
    threads = max(1, cores // workers)
    ctx = mp.get_context("spawn")
    running = ctx.Value("i", 0)
    with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker, initargs=(running,)) as pool:
        futures = {key: pool.submit(drafter_run, **kw, threads=threads) for key, kw in jobs.items()}
        done = {key: f.result() for key, f in futures.items()}
    return {k: v[0] for k, v in done.items()}, {k: v[1] for k, v in done.items()}
