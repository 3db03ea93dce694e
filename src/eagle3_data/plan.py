"""Plan stage: storage and GPU hours of hidden-state extraction, before it runs, with alternatives.

Inputs: the merge manifest (tokens per extraction job, i.e. per merge selection), the merged files'
``dataset``, ``num_tokens`` and ``num_supervised`` columns (DuckDB; for the cap and drop alternatives; the
training shards and, with ``merge.heldout`` > 0, the held-out file: both sets are extracted), the
target's ``config.json`` (layer count, hidden size) and a throughput (tokens/s per GPU: configured, or
measured by :func:`measure_throughput` on the start of the first merged shard).

Arithmetic (printed in the report with the real numbers):

- bytes per token of a layout = auxiliary states ``A*H*b`` (``b`` = bytes of the dtype; fp8: ``A*H*1 + 4*A``
  for the per-token scales) + final states ``H*b`` (times the share of stored rows under
  ``final_states=supervised``, + 1 byte of ``final_mask``) + ids and mask (extract file: int32 + int8 = 5 bytes;
  SpecForge ``.ckpt``: 2 x int64 = 16; speculators ``hs_*``: int64 = 8);
- storage = tokens x bytes per token (+ 8 bytes per sample of offsets), shown in decimal and binary units
  (B, KB = 1e3 ... TB = 1e12; KiB = 2^10 ... TiB = 2^40), the largest that keeps the number >= 1;
- GPU hours = tokens / (tokens/s per GPU) / 3600; wall hours = GPU hours / GPUs in use. Linear in tokens:
  it ignores attention's quadratic share, which makes long samples slower per token (the throughput measured
  on the real shard includes the real length mix).
- alternatives: cap at N tokens (what ``merge.max_len = N`` would keep: ``least(num_tokens, N)``, and, under
  ``overflow: truncate``, samples whose completion would be cut away entirely are dropped, assuming the
  supervised tokens are the sample's last ones, as in ``generation.mode: last``; under ``overflow: drop``
  samples longer than N are dropped), drop a dataset, and both.
"""

from __future__ import annotations

import contextlib
import json
import logging
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import duckdb

from .extract.model import default_layers, model_dims
from .io import write_json, write_text
from .formatting import format_bytes, format_hours

if TYPE_CHECKING:
    from .settings import PlanSettings

__all__ = ["model_dims", "bytes_per_token", "scenario_totals", "measure_throughput", "build_plan", "render_markdown",
           "plan"]

log = logging.getLogger("eagle3_data.plan")

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
TB, TIB = 1e12, float(2 ** 40)


def bytes_per_token(hidden_size: int, num_aux: int = 3, *, dtype: str = "bfloat16", aux_format: str = "same",
                    final: str = "all", final_share: float = 1.0, ids_bytes: int = 5) -> dict:
    """Bytes per token of one layout, by part: ``{aux, final, ids, total}`` (floats).

    ``final``: ``all`` (H rows for every token), ``supervised`` (``final_share`` of the rows + a 1-byte
    mask), ``none`` (not stored). ``ids_bytes``: 5 for the extract file (int32 ids + int8 mask), 16 for
    SpecForge ``.ckpt`` (int64 + int64), 8 for speculators ``hs_*`` (int64 ids).
    """
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"plan: dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
    b = DTYPE_BYTES[dtype]
    H, A = int(hidden_size), int(num_aux)
    aux = A * H * 1 + 4 * A if aux_format == "fp8_e4m3" else A * H * b
    if final == "all":
        fin = H * b
    elif final == "supervised":
        fin = H * b * float(final_share) + 1
    elif final == "none":
        fin = 0
    else:
        raise ValueError(f"plan: final must be all, supervised or none, got {final!r}")
    return {"aux": float(aux), "final": float(fin), "ids": float(ids_bytes), "total": float(aux + fin + ids_bytes)}


def scenario_totals(files, *, cap: int | None = None, drop=(), overflow: str = "truncate") -> dict:
    """Samples, tokens and supervised tokens the merged shards ``files`` would hold under an alternative.

    Args: ``cap`` (tokens per sample, ``None`` = as merged), ``drop`` (dataset names left out),
    ``overflow`` (``truncate`` | ``drop``, as ``merge.overflow``). Returns ``{samples, tokens,
    supervised_tokens, per_dataset: {name: {samples, tokens, supervised_tokens}}}``, the same counts
    ``merge`` with ``max_len = cap`` would produce. When the files have a ``loss_mask`` column (merged
    shards do) the supervised tokens kept by a cut are counted exactly (``list_sum(loss_mask[1:cap])``);
    for files with only ``num_tokens``/``num_supervised`` the supervised span is assumed to end the sample.
    """
    files = [str(f) for f in files]
    if not files:
        return {"samples": 0, "tokens": 0, "supervised_tokens": 0, "per_dataset": {}}
    with contextlib.closing(duckdb.connect()) as con:
        cols = {r[0] for r in con.execute("DESCRIBE SELECT * FROM read_parquet(?)", [files]).fetchall()}
        c = int(cap) if cap else None
        if c and "loss_mask" in cols:
            sup_cut = "coalesce(list_sum(loss_mask[1:$cap]), 0)::BIGINT"
        elif c:
            sup_cut = "greatest(0, least(num_supervised, $cap - (num_tokens - num_supervised)))::BIGINT"
        else:
            sup_cut = "num_supervised::BIGINT"
        con.execute(
            f"CREATE TEMP TABLE samples AS SELECT dataset, num_tokens::BIGINT AS n, num_supervised::BIGINT AS s, "
            f"{sup_cut} AS s_cut FROM read_parquet($files)",
            {"files": files, **({"cap": c} if c else {})},
        )
        if c and overflow == "drop":
            keep, tok, sup = f"n <= {c}", "n", "s"
        elif c:
            keep, tok, sup = f"(n <= {c} OR s_cut > 0)", f"least(n, {c})", f"CASE WHEN n > {c} THEN s_cut ELSE s END"
        else:
            keep, tok, sup = "TRUE", "n", "s"
        rows = con.execute(
            f"SELECT dataset, count(*)::BIGINT, coalesce(sum({tok}), 0)::BIGINT, coalesce(sum({sup}), 0)::BIGINT "
            f"FROM samples WHERE {keep} AND s > 0 AND NOT list_contains($drop, dataset) GROUP BY dataset "
            f"ORDER BY dataset",
            {"drop": [str(d) for d in drop]},
        ).fetchall()
    per = {ds: {"samples": n, "tokens": t, "supervised_tokens": s} for ds, n, t, s in rows}
    return {"samples": sum(v["samples"] for v in per.values()), "tokens": sum(v["tokens"] for v in per.values()),
            "supervised_tokens": sum(v["supervised_tokens"] for v in per.values()), "per_dataset": per}


def measure_throughput(merged_path, *, settings: "PlanSettings") -> dict:
    """Extract the first samples of ``merged_path`` (up to ``settings.measure_tokens`` tokens, at least one sample)
    into a temporary file with the extract settings (``settings.extract``: layout, device, batch size, attention,
    ``gpus_per_job`` devices) and return ``{tokens, seconds, tokens_per_s, tokens_per_s_per_gpu, device,
    samples}`` (model time only; the model load is excluded). Uses the extract stage's code
    (``extract.extract_states``) and devices."""
    import pyarrow.parquet as pq

    from . import schemas
    from .extract import extract_states

    max_tokens = settings.measure_tokens
    table = pq.read_table(merged_path)
    lengths = table.column("num_tokens").to_pylist()
    n, acc = 0, 0
    while n < len(lengths) and (acc < max_tokens or n == 0):
        acc += lengths[n]
        n += 1
    if n == 0:
        raise ValueError(f"plan: {merged_path} has no samples to measure throughput on")
    with tempfile.TemporaryDirectory(prefix=".plan-measure-") as tmp:
        part = Path(tmp) / "part.parquet"
        schemas.write_checked(table.slice(0, n).select(schemas.MERGED.names).cast(schemas.MERGED), "merged", part)
        info = extract_states(part, Path(tmp) / "part.safetensors", settings=settings.extract)
    per_job = info["tokens_per_s"] or 0.0
    used = max(1, len(info.get("devices") or [])) if str(info["device"]).startswith("cuda") else 1
    return {"tokens": info["num_tokens"], "seconds": info["model_seconds"], "tokens_per_s": per_job,
            "tokens_per_s_per_gpu": per_job / used, "device": info["device"], "samples": n}


def build_plan(
    manifest,
    merged_paths,
    *,
    settings: "PlanSettings",
    measured: dict | None = None,
) -> dict:
    """Compute the plan (a JSON-able dict); :func:`render_markdown` turns it into the report.

    Args:
        manifest: the merge manifest (path or dict): per-shard ``samples``, ``tokens``, ``supervised_tokens``
            and the held-out set's (``heldout``; extracted too, so counted in every total).
        merged_paths: the merged shards and the held-out file if any (for the alternatives; may be empty: then
            only "as merged").
        settings: :class:`~eagle3_data.settings.PlanSettings`:
            ``extract.model_path``: target directory (or its config dict): layer count and hidden size.
            ``extract.layers``: auxiliary layers (``None``: EAGLE-3 default for the layer count) -> A = len(layers).
            ``extract.dtype``, ``extract.aux_format``, ``extract.final_states``: the configured extract layout.
            ``tokens_per_s_per_gpu``: configured throughput; or ``measured`` (from :func:`measure_throughput`).
            ``extract.gpus_per_job``, ``gpus_total``: devices per extract job and in the pool (wall hours = GPU
            hours / the GPUs busy at once = ``gpus_per_job * floor(gpus_total / gpus_per_job)``).
            ``caps``: alternative per-sample token caps; ``drop``: alternative datasets to leave out (each alone
            and each combined with each cap).
            ``overflow``: ``merge.overflow`` (how a cap treats longer samples).
        measured: the throughput :func:`measure_throughput` measured, or None.

    Raises: ValueError when no throughput is given (neither configured nor measured).
    """
    e = settings.extract
    model_path, layers, dtype, aux_format, final_states = e.model_path, e.layers, e.dtype, e.aux_format, e.final_states
    gpus_per_job, gpus_total, tokens_per_s_per_gpu = e.gpus_per_job, settings.gpus_total, settings.tokens_per_s_per_gpu
    caps, drop, overflow = settings.caps, settings.drop, settings.overflow
    m = json.loads(Path(manifest).read_text()) if not isinstance(manifest, dict) else manifest
    dims = model_dims(model_path)
    H, L = dims["hidden_size"], dims["num_layers"]
    chosen = list(layers) if layers else default_layers(L)
    A = len(chosen)
    if measured:
        tps, tps_source = float(measured["tokens_per_s_per_gpu"]), "measured"
    elif tokens_per_s_per_gpu:
        tps, tps_source = float(tokens_per_s_per_gpu), "configured"
    else:
        raise ValueError("plan: no throughput: set plan.tokens_per_s_per_gpu or let the plan measure it")
    busy = max(1, gpus_total // max(1, gpus_per_job)) * max(1, gpus_per_job)

    totals = m.get("totals") or {}
    held = m.get("heldout") or {}
    # extraction covers the training shards and the held-out set (merge.heldout): both are in every total
    HN, HT = int(held.get("samples", 0)), int(held.get("tokens", 0))
    T = int(totals.get("tokens", sum(s["tokens"] for s in m["shards"]))) + HT
    N = int(totals.get("samples", sum(s["samples"] for s in m["shards"]))) + HN
    S = int(totals.get("supervised_tokens", sum(s.get("supervised_tokens", 0) for s in m["shards"])))
    S += int(held.get("supervised_tokens", 0))
    # rows a supervised-only final store keeps: supervised + at most one per sample (the row after a span)
    share = min(1.0, (S + N) / T) if T else 0.0

    layouts = {
        "configured": bytes_per_token(H, A, dtype=dtype, aux_format=aux_format, final=final_states,
                                      final_share=share if final_states == "supervised" else 1.0),
        "aux_only_bf16": bytes_per_token(H, 3, dtype="bfloat16", final="none", ids_bytes=0),
        "extract bf16, all finals": bytes_per_token(H, A, dtype="bfloat16"),
        "extract fp8 aux + supervised finals": bytes_per_token(H, A, dtype="bfloat16", aux_format="fp8_e4m3",
                                                               final="supervised", final_share=share),
        "SpecForge .ckpt export": bytes_per_token(H, A, dtype=dtype, ids_bytes=16),
        "speculators hs_*.safetensors export": bytes_per_token(H, A, dtype=dtype, ids_bytes=8),
    }
    bpt = layouts["configured"]["total"]

    # one extraction job per merge selection (per merged shard for a manifest without selections)
    units = ([(key, sel) for key, sel in sorted((m.get("selections") or {}).items())]
             or [(f"{i:03d}", s) for i, s in enumerate(m["shards"])])
    shards = []
    for key, s in units:
        t = int(s["tokens"])
        shards.append({"job": key, "path": s.get("path"), "samples": int(s["samples"]), "tokens": t,
                       "bytes": t * bpt + 8 * (int(s["samples"]) + 1),
                       "gpu_hours": t / tps / 3600.0})

    def scenario(name, cap=None, drop_=()):
        if cap is None and not drop_:
            tot = {"samples": N, "tokens": T, "supervised_tokens": S}
        else:
            tot = scenario_totals(merged_paths, cap=cap, drop=drop_, overflow=overflow)
        t = tot["tokens"]
        gh = t / tps / 3600.0
        return {"name": name, "cap": cap, "drop": list(drop_), "samples": tot["samples"], "tokens": t,
                "bytes": {k: t * v["total"] for k, v in layouts.items()},
                "gpu_hours": gh, "wall_hours": gh / busy}

    scenarios = [scenario("as merged")]
    if merged_paths:
        for c in caps:
            scenarios.append(scenario(f"cap {c:,}", cap=int(c)))
        for d in drop:
            dl = [d] if isinstance(d, str) else list(d)
            scenarios.append(scenario(f"drop {'+'.join(dl)}", drop_=dl))
            for c in caps:
                scenarios.append(scenario(f"cap {c:,} and drop {'+'.join(dl)}", cap=int(c), drop_=dl))
    return {
        "model": {"path": str(model_path) if not isinstance(model_path, dict) else None, **dims},
        "layers": chosen,
        "layout": {"dtype": dtype, "aux_format": aux_format, "final_states": final_states,
                   "final_share": share},
        "bytes_per_token": layouts,
        "throughput": {"tokens_per_s_per_gpu": tps, "source": tps_source, "measured": measured,
                       "gpus_per_job": gpus_per_job, "gpus_total": gpus_total, "gpus_busy": busy},
        "totals": {"samples": N, "tokens": T, "supervised_tokens": S, "heldout_samples": HN, "heldout_tokens": HT,
                   "bytes": T * bpt + 8 * (N + len(shards)),
                   "gpu_hours": T / tps / 3600.0, "wall_hours": T / tps / 3600.0 / busy},
        "shards": shards,
        "scenarios": scenarios,
    }


def _count(n: int, word: str) -> str:
    return f"{n:,} {word}" + ("" if n == 1 else "s")


def measured_on_cpu(thr: dict) -> bool:
    """Whether the plan's throughput was measured on a CPU (then it is no GPU's rate)."""
    m = thr.get("measured") or {}
    return thr.get("source") == "measured" and not str(m.get("device", "")).startswith("cuda")


def throughput_phrase(thr: dict) -> str:
    """The plan's throughput in words: per GPU when configured or measured on GPUs; a CPU measurement says so
    (its GPU hours are the hours at the CPU's rate)."""
    rate = f"{thr['tokens_per_s_per_gpu']:,.1f} tokens/s"
    if measured_on_cpu(thr):
        return (f"{rate} measured on the CPU (no GPU here): every GPU figure below assumes a GPU this slow; set "
                "plan.tokens_per_s_per_gpu, or run plan on a GPU node, for a GPU's rate")
    return f"{rate} per GPU ({thr['source']})"


def wall_line(thr: dict, tot: dict) -> str:
    """The plan's wall-time bullet: on the GPUs in use, or (measured on a CPU) what that rate would give."""
    gpus = (f"{_count(thr['gpus_busy'], 'GPU')} ({thr['gpus_per_job']} per job, of plan.gpus_total = "
            f"{thr['gpus_total']})")
    if measured_on_cpu(thr):
        return (f"- wall time if {gpus} each ran at the CPU's rate: {format_hours(tot['wall_hours'])} (no GPU was "
                "used for this plan)")
    return f"- wall time on {gpus}: {format_hours(tot['wall_hours'])}"


def summary_line(plan: dict, md_path) -> str:
    """One line of the plan: tokens, storage, GPU hours and wall time (``md_path``: where the full plan is)."""
    tot, thr = plan["totals"], plan["throughput"]
    head = (f"plan: {tot['tokens']:,} tokens in {tot['samples']:,} samples -> {format_bytes(tot['bytes'])} of "
            "hidden states")
    tail = f"; read {md_path} before extraction starts"
    if measured_on_cpu(thr):
        return (f"{head}; extraction at this CPU's measured {thr['tokens_per_s_per_gpu']:,.0f} tokens/s: "
                f"{format_hours(tot['gpu_hours'])} (no GPU here: plan on the GPU node, or set "
                f"plan.tokens_per_s_per_gpu, for GPU hours){tail}")
    return (f"{head}, {tot['gpu_hours']:,.4g} GPU hours ({format_hours(tot['wall_hours'])} on "
            f"{_count(thr['gpus_busy'], 'GPU')}){tail}")


def render_markdown(plan: dict) -> str:
    """The plan as a markdown report that shows its arithmetic."""
    H = plan["model"]["hidden_size"]
    A = len(plan["layers"])
    lay = plan["layout"]
    thr = plan["throughput"]
    tot = plan["totals"]
    bpt = plan["bytes_per_token"]
    cfg = bpt["configured"]
    out = ["# Extraction plan", ""]
    out.append(f"Target: {plan['model'].get('path') or '(config)'} ({plan['model']['model_type']}), "
               f"{plan['model']['num_layers']} layers, hidden size H = {H:,}. Auxiliary layers {plan['layers']} "
               f"(output of 0-based decoder layer i), A = {A}.")
    out.append(f"Layout: dtype {lay['dtype']}, auxiliary states {lay['aux_format']}, final states "
               f"{lay['final_states']}" + (f" (share of rows stored {lay['final_share']:.3f})"
                                           if lay['final_states'] == 'supervised' else "") + ".")
    out += ["", "## Bytes per token", "",
            "| layout | auxiliary | final | ids+mask | total | x 1M tokens |", "|---|---:|---:|---:|---:|---:|"]
    for name, v in bpt.items():
        out.append(f"| {name} | {v['aux']:,.0f} | {v['final']:,.0f} | {v['ids']:,.0f} | {v['total']:,.0f} | "
                   f"{format_bytes(v['total'] * 1e6)} |")
    b = 2 if lay["dtype"] != "float32" else 4
    out += ["", f"Configured: auxiliary {A} x {H:,} x {b if lay['aux_format'] == 'same' else 1} B"
            + (" + 4 B scale per layer" if lay["aux_format"] == "fp8_e4m3" else "")
            + f" = {cfg['aux']:,.0f} B; final {cfg['final']:,.0f} B; ids int32 + mask int8 = {cfg['ids']:.0f} B; "
            f"total {cfg['total']:,.0f} B/token.", ""]
    held = ""
    if tot.get("heldout_samples"):
        held = (f"; of which {tot['heldout_tokens']:,} tokens in {tot['heldout_samples']:,} samples are the held-out "
                "set (merge.heldout: extracted and exported for evaluation, never trained on)")
    out += ["## Totals (as merged)", "",
            f"- tokens: {tot['tokens']:,} in {tot['samples']:,} samples ({tot['supervised_tokens']:,} supervised)"
            + held,
            f"- storage: {tot['tokens']:,} x {cfg['total']:,.0f} B = {format_bytes(tot['bytes'])}",
            f"- throughput: {throughput_phrase(thr)}",
            f"- GPU time: {tot['tokens']:,} / {thr['tokens_per_s_per_gpu']:,.1f} / 3600 = {tot['gpu_hours']:,.4g} GPU "
            f"hours ({format_hours(tot['gpu_hours'])})",
            wall_line(thr, tot), ""]
    out += ["## Per extraction job (one per validated dataset shard)", "",
            "| job | samples | tokens | storage | GPU time |", "|---|---:|---:|---:|---:|"]
    for s in plan["shards"]:
        out.append(f"| {s['job']} | {s['samples']:,} | {s['tokens']:,} | {format_bytes(s['bytes'])} | "
                   f"{format_hours(s['gpu_hours'])} |")
    out += ["", "## Alternatives", "",
            "| alternative | samples | tokens | configured layout | aux only bf16 | GPU time | wall time |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    for sc in plan["scenarios"]:
        out.append(f"| {sc['name']} | {sc['samples']:,} | {sc['tokens']:,} | {format_bytes(sc['bytes']['configured'])} | "
                   f"{format_bytes(sc['bytes']['aux_only_bf16'])} | {format_hours(sc['gpu_hours'])} | "
                   f"{format_hours(sc['wall_hours'])} |")
    aux_only = bpt["aux_only_bf16"]["total"]
    full = bpt["SpecForge .ckpt export"]["total"]
    out += ["", "## Notes", "",
            "- Units: KB, MB, GB, TB = 10^3, 10^6, 10^9, 10^12 bytes; KiB, MiB, GiB, TiB = 2^10 ... 2^40 bytes (what "
            "`df -h` / `du -h` print as K, M, G, T). Times: GPU time on one GPU; wall time on the GPUs in use.",
            f"- Three auxiliary layers at bf16 alone are 3 x {H:,} x 2 = {aux_only:,.0f} B/token; with the final "
            f"state and int64 ids/mask (SpecForge's .ckpt) {full:,.0f} B/token, {full / aux_only:.2f}x as much. "
            "An estimate made from the auxiliary states only under-counts storage by that factor.",
            "- GPU hours are linear in tokens: long samples cost more per token (attention), so a cap saves a "
            "little more time than its token share; measure on the real shard for a better figure.",
            "- Which layout an outside estimate assumed can be read off its bytes per token. E.g. 5.5 TB for "
            "138.4M tokens of a H = 7,168 target is 5.5 x 2^40 / 138.4M = 43.7 KB/token (39.7 KB if decimal): "
            "3 auxiliary layers at bf16 (3 x 7,168 x 2 = 43,008 B; 5.41 TiB), not 3 auxiliary + final (8H = "
            "57,344 B; 7.22 TiB) and not 8H in decimal TB (7.94). So that estimate counted the auxiliary states "
            "only, in binary units, and under-stated the disk a SpecForge-style dump needs by a third.",
            "- Cap alternatives count exactly what merge with max_len = N keeps (supervised tokens from the loss "
            "mask; a sample whose supervised tokens a cap would all cut away is dropped, as merge does).", ""]
    return "\n".join(out)


def plan(
    manifest_path,
    merged_paths,
    out_md,
    out_json,
    *,
    settings: "PlanSettings",
) -> dict:
    """Write the plan report (``out_md``) and its figures (``out_json``); return the plan dict.

    ``settings.tokens_per_s_per_gpu``: configured throughput; when ``None`` the throughput is measured on the first
    merged shard (:func:`measure_throughput`: ``settings.measure_tokens`` tokens with the extract settings).
    ``settings``: see :func:`build_plan`.
    """
    merged_paths = [str(p) for p in merged_paths]
    measured = None
    if not settings.tokens_per_s_per_gpu:
        if not merged_paths:
            raise ValueError("plan: no throughput configured and no merged shard to measure it on")
        t0 = time.perf_counter()
        measured = measure_throughput(merged_paths[0], settings=settings)
        unit = "per GPU" if str(measured["device"]).startswith("cuda") else f"on {measured['device']}"
        log.info("measured %.1f tokens/s %s on %s (%d tokens, %.1fs)", measured["tokens_per_s_per_gpu"], unit,
                 merged_paths[0], measured["tokens"], time.perf_counter() - t0)
    p = build_plan(manifest_path, merged_paths, settings=settings, measured=measured)
    write_json(p, out_json)
    write_text(render_markdown(p), out_md)
    log.info("%s", summary_line(p, out_md))
    return p
