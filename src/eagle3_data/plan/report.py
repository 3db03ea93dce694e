"""The plan report: the plan's figures as markdown that shows its arithmetic (:func:`render_markdown`), and its
one-line summary (:func:`summary_line`)."""

from __future__ import annotations

from ..formatting import format_bytes, format_hours
from .sizes import bytes_per_token


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
    cached = (thr.get("measured") or {}).get("cached")
    if cached:
        rate += f" (measured {(thr.get('measured') or {}).get('when', 'before')}, kept in {cached})"
    if measured_on_cpu(thr):
        return (
            f"{rate} measured on the CPU (no GPU here): every GPU figure below assumes a GPU this slow; set "
            "plan.tokens_per_s_per_gpu, or run plan on a GPU node, for a GPU's rate"
        )
    return f"{rate} per GPU ({thr['source']})"


def wall_line(thr: dict, tot: dict) -> str:
    """The plan's wall-time bullet: on the GPUs in use, or (measured on a CPU) what that rate would give."""
    gpus = (
        f"{_count(thr['gpus_busy'], 'GPU')} ({thr['gpus_per_job']} per job, of plan.gpus_total = {thr['gpus_total']})"
    )
    if measured_on_cpu(thr):
        return (
            f"- wall time if {gpus} each ran at the CPU's rate: {format_hours(tot['wall_hours'])} (no GPU was "
            "used for this plan)"
        )
    return f"- wall time on {gpus}: {format_hours(tot['wall_hours'])}"


def summary_line(plan: dict, md_path) -> str:
    """One line of the plan: tokens, storage, GPU hours and wall time (``md_path``: where the full plan is)."""
    tot, thr = plan["totals"], plan["throughput"]
    head = (
        f"plan: {tot['tokens']:,} tokens in {tot['samples']:,} samples -> {format_bytes(tot['bytes'])} of hidden states"
    )
    req = (plan.get("exports") or {}).get("requested") or []
    if req:
        head += f" + {format_bytes(tot['bytes_with_exports'] - tot['bytes'])} of exports ({', '.join(req)})"
    if plan.get("warnings"):
        head += f" [{_count(len(plan['warnings']), 'warning')}]"
    tail = f"; read {md_path} before extraction starts"
    if measured_on_cpu(thr):
        return (
            f"{head}; extraction at this CPU's measured {thr['tokens_per_s_per_gpu']:,.0f} tokens/s: "
            f"{format_hours(tot['gpu_hours'])} (no GPU here: plan on the GPU node, or set "
            f"plan.tokens_per_s_per_gpu, for GPU hours){tail}"
        )
    return (
        f"{head}, {tot['gpu_hours']:,.4g} GPU hours ({format_hours(tot['wall_hours'])} on "
        f"{_count(thr['gpus_busy'], 'GPU')}){tail}"
    )


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
    if plan.get("warnings"):
        out += ["## Warnings", ""] + [f"- **{w}**" for w in plan["warnings"]] + [""]
    drafters = plan.get("drafter_layers") or {"eagle3": plan["layers"]}
    out.append(
        f"Target: {plan['model'].get('path') or '(config)'} ({plan['model']['model_type']}), "
        f"{plan['model']['num_layers']} layers, hidden size H = {H:,}. Auxiliary layers {plan['layers']} "
        f"(output of 0-based decoder layer i), A = {A}: " + "; ".join(f"{d} {v}" for d, v in drafters.items()) + "."
    )
    out.append(
        f"Layout: dtype {lay['dtype']}, auxiliary states {lay['aux_format']}, final states "
        f"{lay['final_states']}"
        + (f" (share of rows stored {lay['final_share']:.3f})" if lay["final_states"] == "supervised" else "")
        + f", {lay.get('final_format', 'same')}, final norm {lay.get('final_norm', 'post')}."
    )
    out += [
        "",
        "## Bytes per token",
        "",
        "| layout | auxiliary | final | ids+mask | total | x 1M tokens |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, v in bpt.items():
        out.append(
            f"| {name} | {v['aux']:,.0f} | {v['final']:,.0f} | {v['ids']:,.0f} | {v['total']:,.0f} | "
            f"{format_bytes(v['total'] * 1e6)} |"
        )
    b = 2 if lay["dtype"] != "float32" else 4
    out += [
        "",
        f"Configured: auxiliary {A} x {H:,} x {b if lay['aux_format'] == 'same' else 1} B"
        + (" + 4 B scale per layer" if lay["aux_format"] == "fp8_e4m3" else "")
        + f" = {cfg['aux']:,.0f} B; final {cfg['final']:,.0f} B; ids int32 + mask int8 = {cfg['ids']:.0f} B; "
        f"total {cfg['total']:,.0f} B/token."
        + (" The final norm's weight (4H B per file) is not counted." if lay.get("final_norm") == "both" else ""),
        "",
    ]
    ex = plan.get("export_bytes_per_token") or {}
    req = (plan.get("exports") or {}).get("requested") or []
    if ex:
        out += [
            "## Exports",
            "",
            "Each export layout is a copy of the states in the form its trainer reads, in the extract dtype "
            "(speculators_fp8: fp8), every row, except an in-place layout (speculators_inplace, specforge_inplace, modelopt_inplace), which writes its "
            "sample table only: its trainer reads the states where extraction wrote them. Bytes per token, and "
            "in total for this build's tokens (requested in export.layouts: **yes**).",
            "",
            "| layout | kind | requested | per token | total |",
            "|---|---|---|---:|---:|",
        ]
        for k, v in ex.items():
            kind = "in place (sample table only)" if not v["aux"] and not v["final"] else "copied"
            out.append(
                f"| {k} | {kind} | {'**yes**' if k in req else 'no'} | {v['total']:,.0f} B | "
                f"{format_bytes(v['total'] * tot['tokens'])} |"
            )
        if req and "bytes_without_copies" in tot:
            out += [
                "",
                f"Disk for the states and the requested exports: {format_bytes(tot['bytes_with_exports'])}; "
                f"without the copies (the states and the in-place sample tables): "
                f"{format_bytes(tot['bytes_without_copies'])}.",
            ]
        out.append("")
    if plan.get("disks"):
        out += [
            "## Disk",
            "",
            "What is still to be written, per filesystem (the states and each requested export, less what the "
            "stage summaries say is already there), against its free space:",
            "",
            "| folders | to write | free | short |",
            "|---|---:|---:|---:|",
        ]
        for d in plan["disks"]:
            out.append(
                f"| {', '.join(d['folders'])} | {format_bytes(d['needed'])} | {format_bytes(d['free'])} | "
                f"{format_bytes(d['short']) if d['short'] else '-'} |"
            )
        out.append("")
    wr = plan.get("write_rate")
    if wr:
        lim = wr.get("limit_bytes_per_s")
        out += [
            "## Write rate",
            "",
            f"- {thr['tokens_per_s_per_gpu']:,.1f} tokens/s per GPU x {cfg['total']:,.0f} B/token = "
            f"{wr['bytes_per_s_per_gpu'] / 1e9:,.3f} GB/s per GPU; on {_count(wr['gpus'], 'GPU')} "
            f"{wr['bytes_per_s'] / 1e9:,.3f} GB/s into the states' filesystem"
            + (
                f" (plan.write_gb_per_s: {lim / 1e9:,.2f} GB/s)"
                if lim
                else " (set plan.write_gb_per_s to compare with the filesystem's rate)"
            )
            + ".",
            "- For scale: an 8B target (H = 4,096) at 27,000 prefill tokens/s on one H200 (SpecForge's published "
            f"capture rate) writes {27_000 * bytes_per_token(4096, 3)['total'] / 1e9:,.2f} GB/s per GPU in bf16 "
            f"({bytes_per_token(4096, 3)['total']:,.0f} B/token), "
            f"{27_000 * bytes_per_token(4096, 3, aux_format='fp8_e4m3', final_format='fp8_e4m3')['total'] / 1e9:,.2f}"
            " GB/s with extract.aux_format and extract.final_format fp8_e4m3.",
            "",
        ]
    held = ""
    if tot.get("heldout_samples"):
        held = (
            f"; of which {tot['heldout_tokens']:,} tokens in {tot['heldout_samples']:,} samples are the held-out "
            "set (merge.heldout: extracted and exported for evaluation, never trained on)"
        )
    out += [
        "## Totals (as merged)",
        "",
        f"- tokens: {tot['tokens']:,} in {tot['samples']:,} samples ({tot['supervised_tokens']:,} supervised)" + held,
        f"- storage: {tot['tokens']:,} x {cfg['total']:,.0f} B = {format_bytes(tot['bytes'])}",
        f"- throughput: {throughput_phrase(thr)}",
        f"- GPU time: {tot['tokens']:,} / {thr['tokens_per_s_per_gpu']:,.1f} / 3600 = {tot['gpu_hours']:,.4g} GPU "
        f"hours ({format_hours(tot['gpu_hours'])})",
        wall_line(thr, tot),
        "",
    ]
    out += [
        "## Per extraction job (one per validated dataset shard)",
        "",
        "| job | samples | tokens | storage | GPU time |",
        "|---|---:|---:|---:|---:|",
    ]
    for s in plan["shards"]:
        out.append(
            f"| {s['job']} | {s['samples']:,} | {s['tokens']:,} | {format_bytes(s['bytes'])} | "
            f"{format_hours(s['gpu_hours'])} |"
        )
    out += [
        "",
        "## Alternatives",
        "",
        "| alternative | samples | tokens | configured layout | aux only bf16 | GPU time | wall time |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for sc in plan["scenarios"]:
        out.append(
            f"| {sc['name']} | {sc['samples']:,} | {sc['tokens']:,} | {format_bytes(sc['bytes']['configured'])} | "
            f"{format_bytes(sc['bytes']['aux_only_bf16'])} | {format_hours(sc['gpu_hours'])} | "
            f"{format_hours(sc['wall_hours'])} |"
        )
    aux_only = bpt["aux_only_bf16"]["total"]
    full = (ex.get("specforge") or bytes_per_token(H, 3, dtype=lay["dtype"], ids_bytes=16))["total"]
    out += [
        "",
        "## Notes",
        "",
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
        "mask; a sample whose supervised tokens a cap would all cut away is dropped, as merge does).",
        "",
    ]
    return "\n".join(out)
