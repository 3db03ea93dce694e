"""Plan stage: storage, write rate and GPU hours of hidden-state extraction, before it runs, with alternatives.

Inputs: the merge manifest (tokens per extraction job, i.e. per merge selection), the merged files'
``dataset``, ``num_tokens`` and ``num_supervised`` columns (DuckDB; for the cap and drop alternatives; the
training shards and, with ``merge.heldout`` > 0, the held-out file: both sets are extracted), the
target's ``config.json`` (layer count, hidden size), a throughput (tokens/s per GPU: configured, or
measured by :func:`measure_throughput` on the start of the first merged shard, the figure kept under
``cache_dir/plan/`` for the same settings) and the filesystems the states and the exports go to.

Arithmetic (printed in the report with the real numbers):

- bytes per token of the states = auxiliary states ``U*H*b`` (U = the stored layers: the union of the requested
  drafters'; ``b`` = bytes of the dtype; fp8: ``U*H*1 + 4*U`` for the per-token scales) + final states ``H*b``
  (fp8: ``H + 4``; times the share of stored rows under ``final_states=supervised``, + 1 byte of ``final_mask``)
  + ids and mask (int32 + int8 = 5 bytes); :func:`bytes_per_token`;
- bytes per token of each export layout (:func:`export_bytes_per_token`, the extract dtype, every row): SpecForge
  EAGLE-3 ``.ckpt`` and Model-Optimizer ``.pt`` ``A*H*b + H*b + 16`` (int64 ids and mask), DFlash ``F*H*b + 16``,
  DSpark ``F*H*b + H*b + 16``, speculators ``(A+1)*H*b + 8`` (int64 ids), speculators FP8 ``(A+1)*H + 12``
  (A = EAGLE-3's 3 layers, F = DFlash's 5); each file's own header (a few hundred bytes per sample) comes on top;
  the in-place layouts (``speculators_inplace``, ``specforge_inplace``, ``modelopt_inplace``) copy no states: their
  sample table's ``16`` (int64 ids and mask, before compression);
- storage = tokens x bytes per token (+ 8 bytes per sample of offsets), shown in decimal and binary units
  (B, KB = 1e3 ... TB = 1e12; KiB = 2^10 ... TiB = 2^40), the largest that keeps the number >= 1;
- disk (:func:`sink_check`): per filesystem (``results/hidden_states/``, ``results/export/``: the nearest existing
  folder's, one row per device), the bytes still to be written there (the states and every requested export, less
  what the stage summaries say is already written) against its free space;
- write rate = tokens/s per GPU x GPUs busy x bytes per token of the states (compared with
  ``plan.write_gb_per_s`` when set): what the sink must absorb while extraction runs;
- GPU hours = tokens / (tokens/s per GPU) / 3600; wall hours = GPU hours / GPUs in use. Linear in tokens:
  it ignores attention's quadratic share, which makes long samples slower per token (the throughput measured
  on the real shard includes the real length mix).
- alternatives: cap at N tokens (what ``merge.max_len = N`` would keep: ``least(num_tokens, N)``, and, under
  ``overflow: truncate``, samples whose completion would be cut away entirely are dropped, assuming the
  supervised tokens are the sample's last ones, as in ``generation.mode: last``; under ``overflow: drop``
  samples longer than N are dropped), drop a dataset, and both.

A shortfall of disk or write rate is a warning in the report and the job's log, naming the settings that fix it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import duckdb

from ..logs import NOTICE
from ..extract.model import (
    DFLASH_DRAFT_LAYERS,
    default_layers,
    dflash_layer_ids,
    model_dims,
    model_fingerprint,
    resolve_drafter_layers,
)
from ..files import write_json, write_text
from ..formatting import format_bytes
from .report import render_markdown, summary_line
from .sizes import DTYPE_BYTES, TB, TIB, bytes_per_token, export_bytes_per_token  # noqa: F401

if TYPE_CHECKING:
    from ..settings import PlanSettings

__all__ = [
    "model_dims",
    "bytes_per_token",
    "export_bytes_per_token",
    "sink_check",
    "scenario_totals",
    "measure_throughput",
    "build_plan",
    "render_markdown",
    "plan",
]

log = logging.getLogger("eagle3_data.plan")


def _existing_dir(path) -> Path:
    """``path`` or its nearest existing ancestor (the folder whose filesystem it will be on)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def written_bytes(states_dir, export_dir, layouts) -> dict:
    """Bytes the states and the exports of ``layouts`` already hold, from the stage summaries
    (``<states_dir>/*/*.json``, ``<export_dir>/<layout>/*.json``, ``<export_dir>/heldout/<layout>.json``: their
    ``bytes``; an export manifest without it counts 0): ``{"states": n, "<layout>": n, ...}``."""

    def total(paths) -> int:
        n = 0
        for p in paths:
            try:
                n += int(json.loads(Path(p).read_text()).get("bytes") or 0)
            except (OSError, ValueError, AttributeError):
                continue
        return n

    out = {"states": total(Path(states_dir).glob("*/*.json")) if Path(states_dir).is_dir() else 0}
    for layout in layouts:
        d = Path(export_dir)
        out[layout] = total(list((d / layout).glob("*.json")) + [d / "heldout" / f"{layout}.json"])
    return out


def sink_check(needed: dict, places: dict, written: dict | None = None) -> list[dict]:
    """Free space against the bytes still to be written, per filesystem.

    ``needed``: ``{part: bytes}`` (``states``, each export layout); ``places``: ``{part: folder}`` (the folder each
    part goes to; need not exist yet: its nearest existing ancestor's filesystem counts); ``written``: bytes of each
    part already on disk (subtracted: a rerun rewrites them in place). Returns one row per filesystem:
    ``{device, folders, parts, needed, free, short}`` (``short`` = needed - free when positive, else 0)."""
    written = written or {}
    rows: dict = {}
    for part, nbytes in needed.items():
        d = _existing_dir(places[part])
        dev = os.stat(d).st_dev
        row = rows.setdefault(
            dev,
            {
                "device": dev,
                "folders": [],
                "parts": {},
                "needed": 0.0,
                "free": float(shutil.disk_usage(d).free),
                "short": 0.0,
            },
        )
        if str(places[part]) not in row["folders"]:
            row["folders"].append(str(places[part]))
        left = max(0.0, float(nbytes) - float(written.get(part, 0)))
        row["parts"][part] = left
        row["needed"] += left
    for row in rows.values():
        row["short"] = max(0.0, row["needed"] - row["free"])
    return list(rows.values())


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
    return {
        "samples": sum(v["samples"] for v in per.values()),
        "tokens": sum(v["tokens"] for v in per.values()),
        "supervised_tokens": sum(v["supervised_tokens"] for v in per.values()),
        "per_dataset": per,
    }


def measure_key(merged_path, settings: "PlanSettings") -> str:
    """What a throughput measurement depends on: the extract settings the plan measures with
    (``settings.extract_params()``), ``measure_tokens``, the target checkpoint and the measured samples' ids (the
    first rows of ``merged_path``). Digest (hex, 16)."""
    import pyarrow.parquet as pq

    ids = pq.read_table(merged_path, columns=["sample_id"]).column("sample_id").to_pylist()[:1000]
    key = {
        "extract": settings.extract_params(),
        "measure_tokens": settings.measure_tokens,
        "target": model_fingerprint(settings.extract.model_path),
        "samples": ids,
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]


def measure_throughput(merged_path, *, settings: "PlanSettings", cache: bool = True) -> dict:
    """Extract the first samples of ``merged_path`` (up to ``settings.measure_tokens`` tokens, at least one sample)
    into a temporary file with the extract settings (``settings.extract``: layout, device, batch size, attention,
    ``gpus_per_job`` devices) and return ``{tokens, seconds, tokens_per_s, tokens_per_s_per_gpu, device,
    samples}`` (model time only; the model load is excluded). Uses the extract stage's code
    (``extract.extract_states``) and devices.

    With ``cache``, the figure is kept in ``<cache_dir>/plan/throughput-<key>.json`` (:func:`measure_key`) and a
    later plan with the same key reuses it (``cached``: that file) instead of loading the target again: a plan
    rewritten for another ``export.layouts`` or ``plan.caps`` measures nothing."""
    import pyarrow.parquet as pq

    from .. import schemas
    from ..extract import extract_states

    stash = None
    if cache:
        stash = Path(settings.cache_dir) / "plan" / f"throughput-{measure_key(merged_path, settings)}.json"
        if stash.is_file():
            try:
                return {**json.loads(stash.read_text()), "cached": str(stash)}
            except ValueError:
                pass
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
    out = {
        "tokens": info["num_tokens"],
        "seconds": info["model_seconds"],
        "tokens_per_s": per_job,
        "tokens_per_s_per_gpu": per_job / used,
        "device": info["device"],
        "samples": n,
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    if stash is not None:
        write_json(out, stash)
    return out


def build_plan(
    manifest,
    merged_paths,
    *,
    settings: "PlanSettings",
    measured: dict | None = None,
    states_dir="results/hidden_states",
    export_dir="results/export",
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
            ``extract.drafters``, ``extract.dflash_layers``: the stored layers are the union of the drafters'.
            ``extract.final_format``: the final states' storage.
            ``export_layouts``: the exports whose bytes the disk check adds; ``write_gb_per_s``: the sink's write
            rate (None: not compared).
        measured: the throughput :func:`measure_throughput` measured, or None.
        states_dir, export_dir: where the states and the exports go (their filesystems' free space is checked).

    Raises: ValueError when no throughput is given (neither configured nor measured).
    """
    e = settings.extract
    model_path, layers, dtype, aux_format, final_states = e.model_path, e.layers, e.dtype, e.aux_format, e.final_states
    final_format = e.final_format
    gpus_per_job, gpus_total, tokens_per_s_per_gpu = e.gpus_per_job, settings.gpus_total, settings.tokens_per_s_per_gpu
    caps, drop, overflow = settings.caps, settings.drop, settings.overflow
    m = json.loads(Path(manifest).read_text()) if not isinstance(manifest, dict) else manifest
    dims = model_dims(model_path)
    H, L = dims["hidden_size"], dims["num_layers"]
    chosen, per_drafter = resolve_drafter_layers(e.drafters, layers, e.dflash_layers, L)
    A = len(chosen)
    A3 = len(per_drafter.get("eagle3") or default_layers(L))
    try:
        F = len(per_drafter.get("dflash") or per_drafter.get("dspark") or dflash_layer_ids(L))
    except ValueError:  # a target too shallow for DFlash's default layers
        F = DFLASH_DRAFT_LAYERS
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

    cfg_share = share if final_states == "supervised" else 1.0
    layouts = {
        "configured": bytes_per_token(
            H,
            A,
            dtype=dtype,
            aux_format=aux_format,
            final=final_states,
            final_share=cfg_share,
            final_format=final_format,
        ),
        "aux_only_bf16": bytes_per_token(H, 3, dtype="bfloat16", final="none", ids_bytes=0),
        "extract bf16, all finals": bytes_per_token(H, A, dtype="bfloat16"),
        "extract fp8 aux + fp8 finals": bytes_per_token(
            H, A, dtype="bfloat16", aux_format="fp8_e4m3", final_format="fp8_e4m3"
        ),
        "extract fp8 aux + supervised finals": bytes_per_token(
            H, A, dtype="bfloat16", aux_format="fp8_e4m3", final="supervised", final_share=share
        ),
        "extract fp8 aux + supervised fp8 finals": bytes_per_token(
            H,
            A,
            dtype="bfloat16",
            aux_format="fp8_e4m3",
            final="supervised",
            final_share=share,
            final_format="fp8_e4m3",
        ),
    }
    from ..export import INPLACE_LAYOUTS, LAYOUTS

    exports = {k: export_bytes_per_token(k, H, eagle3_layers=A3, dflash_layers=F, dtype=dtype) for k in LAYOUTS}
    bpt = layouts["configured"]["total"]

    # one extraction job per merge selection (per merged shard for a manifest without selections)
    units = [(key, sel) for key, sel in sorted((m.get("selections") or {}).items())] or [
        (f"{i:03d}", s) for i, s in enumerate(m["shards"])
    ]
    shards = []
    for key, s in units:
        t = int(s["tokens"])
        shards.append(
            {
                "job": key,
                "path": s.get("path"),
                "samples": int(s["samples"]),
                "tokens": t,
                "bytes": t * bpt + 8 * (int(s["samples"]) + 1),
                "gpu_hours": t / tps / 3600.0,
            }
        )

    def scenario(name, cap=None, drop_=()):
        if cap is None and not drop_:
            tot = {"samples": N, "tokens": T, "supervised_tokens": S}
        else:
            tot = scenario_totals(merged_paths, cap=cap, drop=drop_, overflow=overflow)
        t = tot["tokens"]
        gh = t / tps / 3600.0
        return {
            "name": name,
            "cap": cap,
            "drop": list(drop_),
            "samples": tot["samples"],
            "tokens": t,
            "bytes": {k: t * v["total"] for k, v in layouts.items()},
            "gpu_hours": gh,
            "wall_hours": gh / busy,
        }

    scenarios = [scenario("as merged")]
    if merged_paths:
        for c in caps:
            scenarios.append(scenario(f"cap {c:,}", cap=int(c)))
        for d in drop:
            dl = [d] if isinstance(d, str) else list(d)
            scenarios.append(scenario(f"drop {'+'.join(dl)}", drop_=dl))
            for c in caps:
                scenarios.append(scenario(f"cap {c:,} and drop {'+'.join(dl)}", cap=int(c), drop_=dl))
    requested = [k for k in (settings.export_layouts or []) if k in exports]
    states_bytes = T * bpt + 8 * (N + len(shards))
    needed = {"states": states_bytes, **{k: T * exports[k]["total"] for k in requested}}
    places = {"states": str(states_dir), **{k: str(Path(export_dir) / k) for k in requested}}
    written = written_bytes(states_dir, export_dir, requested)
    disks = sink_check(needed, places, written)
    busy_tps = tps * busy
    write = {
        "bytes_per_s": busy_tps * bpt,
        "bytes_per_s_per_gpu": tps * bpt,
        "gpus": busy,
        "limit_bytes_per_s": settings.write_gb_per_s * 1e9 if settings.write_gb_per_s else None,
    }
    warnings = _warnings(disks, write, e, H=H, A=A, requested=requested)
    return {
        "model": {"path": str(model_path) if not isinstance(model_path, dict) else None, **dims},
        "layers": chosen,
        "drafter_layers": per_drafter,
        "layout": {
            "dtype": dtype,
            "aux_format": aux_format,
            "final_states": final_states,
            "final_share": share,
            "final_format": final_format,
            "final_norm": e.final_norm,
        },
        "bytes_per_token": layouts,
        "export_bytes_per_token": exports,
        "exports": {
            "requested": requested,
            "bytes": {k: needed[k] for k in requested},
            "written": written,
            # the layouts that copy no states (their trainer reads results/hidden_states/ in place)
            "in_place": [k for k in requested if k in INPLACE_LAYOUTS],
        },
        "disks": disks,
        "write_rate": write,
        "warnings": warnings,
        "throughput": {
            "tokens_per_s_per_gpu": tps,
            "source": tps_source,
            "measured": measured,
            "gpus_per_job": gpus_per_job,
            "gpus_total": gpus_total,
            "gpus_busy": busy,
        },
        "totals": {
            "samples": N,
            "tokens": T,
            "supervised_tokens": S,
            "heldout_samples": HN,
            "heldout_tokens": HT,
            "bytes": states_bytes,
            "bytes_with_exports": sum(needed.values()),
            # the same without the requested copies: the states and the in-place layouts' sample tables
            "bytes_without_copies": states_bytes + sum(needed[k] for k in requested if k in INPLACE_LAYOUTS),
            "gpu_hours": T / tps / 3600.0,
            "wall_hours": T / tps / 3600.0 / busy,
        },
        "shards": shards,
        "scenarios": scenarios,
    }


def _fixes(e, *, H: int, A: int, requested: list, rate: bool = False) -> list[str]:
    """The settings that shrink what is written (``rate``: what extraction writes per token), among those not
    already chosen (for a warning)."""
    out = []
    fp8 = bytes_per_token(H, A, aux_format="fp8_e4m3", final_format="fp8_e4m3")["total"]
    if e.aux_format != "fp8_e4m3" or e.final_format != "fp8_e4m3":
        out.append(
            f"extract.aux_format: fp8_e4m3 and extract.final_format: fp8_e4m3 (the states at {fp8:,.0f} B/token)"
        )
    if e.final_states != "supervised":
        out.append("extract.final_states: supervised (final states only where the loss reads them)")
    if rate:
        return out
    if "speculators" in requested:
        out.append("export.layouts: speculators_fp8 instead of speculators (half its bytes)")
    if requested:
        out.append(
            "fewer export.layouts (each is a full copy), or export one merged shard at a time "
            "(snakemake results/export/<layout>/<k>.json) and delete it once trained on"
        )
    out.append("a lower merge.max_len or a dataset left out (the alternatives below)")
    return out


def _warnings(disks: list, write: dict, e, *, H: int, A: int, requested: list) -> list[str]:
    """One line per shortfall (disk space per filesystem, write rate), naming what fixes it."""
    out = []
    fixes = "; ".join(_fixes(e, H=H, A=A, requested=requested))
    for d in disks:
        if d["short"] > 0:
            parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in d["parts"].items())
            out.append(
                f"disk: {' and '.join(d['folders'])} need {format_bytes(d['needed'])} ({parts}) but their "
                f"filesystem has {format_bytes(d['free'])} free, {format_bytes(d['short'])} short; set {fixes}"
            )
    lim = write.get("limit_bytes_per_s")
    if lim and write["bytes_per_s"] > lim:
        out.append(
            f"write rate: {write['gpus']} GPU(s) extracting write {write['bytes_per_s'] / 1e9:,.2f} GB/s of "
            f"states, more than plan.write_gb_per_s = {lim / 1e9:,.2f} GB/s (extraction would wait on the "
            f"disk); set {'; '.join(_fixes(e, H=H, A=A, requested=[], rate=True) + [''])}or fewer GPUs "
            "at once (plan.gpus_total)"
        )
    return out


def plan(
    manifest_path,
    merged_paths,
    out_md,
    out_json,
    *,
    settings: "PlanSettings",
    states_dir="results/hidden_states",
    export_dir="results/export",
) -> dict:
    """Write the plan report (``out_md``) and its figures (``out_json``); return the plan dict.

    ``settings.tokens_per_s_per_gpu``: configured throughput; when ``None`` the throughput is measured on the first
    merged shard (:func:`measure_throughput`: ``settings.measure_tokens`` tokens with the extract settings, or the
    figure kept from an earlier plan with the same settings). ``settings``, ``states_dir``, ``export_dir``: see
    :func:`build_plan`. Each warning (disk or write rate short) is logged too.
    """
    merged_paths = [str(p) for p in merged_paths]
    measured = None
    if not settings.tokens_per_s_per_gpu:
        if not merged_paths:
            raise ValueError("plan: no throughput configured and no merged shard to measure it on")
        t0 = time.perf_counter()
        measured = measure_throughput(merged_paths[0], settings=settings)
        unit = "per GPU" if str(measured["device"]).startswith("cuda") else f"on {measured['device']}"
        how = f"reused from {measured['cached']}" if measured.get("cached") else f"{time.perf_counter() - t0:.1f}s"
        log.info(
            "measured %.1f tokens/s %s on %s (%d tokens, %s)",
            measured["tokens_per_s_per_gpu"],
            unit,
            merged_paths[0],
            measured["tokens"],
            how,
        )
    p = build_plan(
        manifest_path, merged_paths, settings=settings, measured=measured, states_dir=states_dir, export_dir=export_dir
    )
    write_json(p, out_json)
    write_text(render_markdown(p), out_md)
    for w in p["warnings"]:
        log.warning("plan: %s", w)
    log.log(NOTICE, "%s", summary_line(p, out_md))  # shown on the console, also under the live view
    return p
