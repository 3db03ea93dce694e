"""Rule report's job: the tally and every report of the build, written as CSV, Markdown and HTML."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import pyarrow as pa

from ..config.lookup import answers_of
from ..formatting import format_duration, format_usd
from ..files import write_text
from .db import materialize, open_report_db, query, write_csv
from .markdown import (
    FRONT_PAGE,
    format_audit,
    format_cost,
    format_limits,
    format_rejects,
    format_tally,
    format_throughput,
    front_page_fragment,
    write_markdown,
)
from .outputs import AUDIT_COLUMNS, COST_COLUMNS, LIMIT_COLUMNS, REJECT_COLUMNS, TALLY_COLUMNS, THROUGHPUT_COLUMNS


log = logging.getLogger("eagle3_data.report")


#: bucket lengths (seconds) the Markdown throughput table may use; the smallest giving <= MAX_MD_BUCKETS rows
MD_BUCKETS_S = [60, 300, 600, 900, 1800, 3600, 7200, 4 * 3600, 6 * 3600, 12 * 3600, 86400]
MAX_MD_BUCKETS = 240


#: the tally's source of a dataset trained on its own answers (answers: original): no backend, no cost
ORIGINAL_SOURCE = "Original answers"


def _source_label(pretokenized: bool, locations: list[str], original: bool = False) -> str:
    if pretokenized:
        return "Pre-tokenized"
    if original:
        return ORIGINAL_SOURCE
    locs = set(locations)
    if not locs:
        return ""
    if locs == {"local"}:
        return "Local"
    if locs == {"remote"}:
        return "Remote"
    if locs == {"unknown"}:
        return "Unknown"
    return "Mixed"


def tally(
    validated_paths,
    rejected_paths,
    responses_paths,
    out_dir,
    *,
    datasets_config: dict | None = None,
    backends: dict | None = None,
) -> list[dict]:
    """Per-dataset tally of the build; writes ``out_dir/tally.md``, ``tally.html``, ``tally.csv`` and
    ``rejects.csv``.

    Args:
        validated_paths: VALIDATED parquet files (the samples and tokens counted).
        rejected_paths: REJECTS parquet files of any stage (counted per dataset, stage and reason).
        responses_paths: RESPONSES parquet files (responses ok/failed and ``cost_usd`` per dataset).
        out_dir: directory for the four files (each written atomically).
        datasets_config: the config's ``datasets`` mapping; every dataset in it gets a row (zeros when it has
            no data); one whose ``source.format`` is ``pretokenized`` is listed with the pre-tokenized ones, one
            with ``answers: original`` with the original-answers ones.
        backends: the config's ``backends`` mapping (name -> ``type``, ``base_url``, ``launch``) used to tell
            local from remote (:func:`backend_location`).

    Returns: the table rows (dicts with :data:`TALLY_COLUMNS`): generated datasets, then ``Total generated``,
        then the datasets trained on their own answers (source ``Original answers``), ``Total original answers``,
        then pre-tokenized datasets, ``Total pre-tokenized``, then ``Grand total`` (``kind`` is
        ``generated`` / ``original`` / ``pretokenized`` / ``total``); a subtotal is left out when there is no
        dataset of its kind (``Grand total`` is always the last row). Token counts: ``completion_tokens`` = supervised
        tokens (loss mask 1), ``prompt_tokens`` = the rest, ``total_tokens`` = their sum.
    """
    datasets_config = datasets_config or {}
    out_dir = Path(out_dir)
    with contextlib.closing(
        open_report_db(validated_paths, rejected_paths, responses_paths, backends=backends, summary_paths=[])
    ) as con:
        rows, rejects = _tally_rows(con, datasets_config)
        _write_tally(con, rows, rejects, out_dir)
    return rows


def _tally_rows(con, datasets_config: dict) -> tuple[list[dict], list[dict]]:
    found = {r["dataset"]: r for r in query(con, "tally")}
    rejects = materialize(con, "report_rejects", "rejects_by_reason")

    names = sorted(set(found) | set(datasets_config))
    generated, original, pretok = [], [], []
    for name in names:
        r = found.get(name) or {
            "samples": 0,
            "prompt_tokens": 0,
            "completion_tokens": 0,
            "total_tokens": 0,
            "pretokenized_samples": 0,
            "original_samples": 0,
            "backends": [],
            "locations": [],
            "rejected": 0,
            "responses_ok": 0,
            "responses_failed": 0,
            "cost_usd": 0.0,
        }
        fmt = ((datasets_config.get(name) or {}).get("source") or {}).get("format")
        is_pre = fmt == "pretokenized" or (r["samples"] > 0 and r["pretokenized_samples"] == r["samples"])
        is_orig = not is_pre and (
            answers_of(datasets_config.get(name)) == "original"
            or (r["samples"] > 0 and r["original_samples"] == r["samples"])
        )
        row = {
            "dataset": name,
            "kind": "pretokenized" if is_pre else "original" if is_orig else "generated",
            "samples": int(r["samples"]),
            "prompt_tokens": int(r["prompt_tokens"]),
            "completion_tokens": int(r["completion_tokens"]),
            "total_tokens": int(r["total_tokens"]),
            "source": _source_label(is_pre, list(r["locations"]), is_orig),
            "backends": ",".join(r["backends"]),
            "rejected": int(r["rejected"]),
            "responses_ok": int(r["responses_ok"]),
            "responses_failed": int(r["responses_failed"]),
            "cost_usd": float(r["cost_usd"]),
        }
        (pretok if is_pre else original if is_orig else generated).append(row)

    def total(label: str, rows: list[dict]) -> dict:
        t = {"dataset": label, "kind": "total", "source": "", "backends": ""}
        for c in TALLY_COLUMNS:
            if c not in t:
                t[c] = sum(r[c] for r in rows)
        return t

    rows = list(generated)
    if generated:
        rows.append(total("Total generated", generated))
    rows += original
    if original:
        rows.append(total("Total original answers", original))
    rows += pretok
    if pretok:  # no all-zero subtotal when the build has no pre-tokenized dataset
        rows.append(total("Total pre-tokenized", pretok))
    rows.append(total("Grand total", generated + original + pretok))
    return rows, rejects


def _write_tally(con, rows: list[dict], rejects: list[dict], out_dir: Path) -> None:
    """tally.csv/.md/.html and rejects.csv (``rejects``: the ``report_rejects`` table of :func:`materialize`)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    con.register("report_tally", pa.Table.from_pylist(rows))
    write_csv(con, "report_tally", TALLY_COLUMNS, out_dir / "tally.csv")
    write_csv(con, "report_rejects", REJECT_COLUMNS, out_dir / "rejects.csv")
    md = "# Tally\n\n" + format_tally(rows) + "\n\n## Rejects by reason\n\n" + format_rejects(rejects) + "\n"
    write_markdown(md, out_dir / "tally.md", out_dir / "tally.html", title="Tally")
    g = rows[-1]
    log.info(
        "tally: %d samples, %d tokens (%d supervised), %d rejected, $%s",
        g["samples"],
        g["total_tokens"],
        g["completion_tokens"],
        g["rejected"],
        format_usd(g["cost_usd"]),
    )


def md_bucket_s(con) -> int:
    """Bucket length (s) for the Markdown throughput table: the smallest of :data:`MD_BUCKETS_S` giving at
    most :data:`MAX_MD_BUCKETS` rows over the responses' ``completed_at`` span."""
    span = con.execute("SELECT coalesce(max(completed_at) - min(completed_at), 0) FROM responses").fetchall()[0][0]
    for b in MD_BUCKETS_S:
        if span / b < MAX_MD_BUCKETS:
            return b
    return MD_BUCKETS_S[-1]


def write_reports(
    validated_paths,
    rejected_paths,
    responses_paths,
    out_dir,
    *,
    datasets_config: dict | None = None,
    backends: dict | None = None,
    generation: dict | None = None,
    summary_paths=None,
) -> dict[str, list[dict]]:
    """Write every report of the build into ``out_dir`` as CSV, Markdown and HTML (:data:`REPORT_FILES`).

    Args:
        validated_paths, rejected_paths, responses_paths: the stage parquet files (as for :func:`tally`).
        out_dir: directory for the files (each written atomically).
        datasets_config: the config's ``datasets`` mapping (rows for datasets with no data; pre-tokenized
            ones apart; shards per dataset for the limits report).
        backends: the config's ``backends`` mapping (local/remote source labels).
        generation: dataset -> its merged generation config (``config.generation_config``); the limits
            report shows ``max_samples``, ``budget_completion_tokens``, ``budget_usd`` from it.
        summary_paths: generate's per-shard summary JSON files; None: the ``.json`` beside each responses
            parquet where it exists.

    Returns: ``{"tally": rows, "rejects": rows, "cost": rows, "throughput": rows (60 s buckets),
        "limits": rows, "audit": rows}``, each row a dict with the columns of the CSV (:data:`TALLY_COLUMNS`,
        :data:`REJECT_COLUMNS`, :data:`COST_COLUMNS`, :data:`THROUGHPUT_COLUMNS`, :data:`LIMIT_COLUMNS`,
        :data:`AUDIT_COLUMNS`).
        Throughput times are UTC; dollars as the backends reported them (0 for local servers).

    Raises: ``FileNotFoundError`` naming missing input files.
    """
    datasets_config = datasets_config or {}
    out_dir = Path(out_dir)
    with contextlib.closing(
        open_report_db(
            validated_paths,
            rejected_paths,
            responses_paths,
            backends=backends,
            datasets_config=datasets_config,
            generation=generation,
            summary_paths=summary_paths,
        )
    ) as con:
        rows, rejects = _tally_rows(con, datasets_config)
        cost = materialize(con, "report_cost", "cost")
        throughput = materialize(con, "report_throughput", "throughput", bucket_s=60)
        bucket = md_bucket_s(con)
        throughput_md = throughput if bucket == 60 else query(con, "throughput", bucket_s=bucket)
        limits = materialize(con, "report_limits", "limits")
        audit = materialize(con, "report_audit", "audit")
        _write_tally(con, rows, rejects, out_dir)
        for table, columns, stem in (
            ("report_cost", COST_COLUMNS, "cost"),
            ("report_throughput", THROUGHPUT_COLUMNS, "throughput"),
            ("report_limits", LIMIT_COLUMNS, "limits"),
            ("report_audit", AUDIT_COLUMNS, "audit"),
        ):
            write_csv(con, table, columns, out_dir / f"{stem}.csv")
    pages = {
        "rejects": ("Rejects by dataset, stage and reason", format_rejects(rejects)),
        "cost": ("Cost and tokens by dataset, backend and provider", format_cost(cost)),
        "throughput": (
            f"Throughput ({format_duration(bucket)} buckets of completed_at, UTC)",
            format_throughput(throughput_md, bucket),
        ),
        "limits": ("Which limit ended each dataset", format_limits(limits)),
        "audit": ("Token audit: billed counts vs the target's own", format_audit(audit)),
    }
    for stem, (title, table) in pages.items():
        write_markdown(f"# {title}\n\n{table}\n", out_dir / f"{stem}.md", out_dir / f"{stem}.html", title=title)
    write_text(front_page_fragment(out_dir), out_dir / FRONT_PAGE)
    total_audit = audit[-1] if audit else {}
    if (
        total_audit.get("prompt_billed_samples")
        and total_audit["prompt_equal_samples"] < total_audit["prompt_billed_samples"]
    ):
        log.warning(
            "audit: %d of %d generated samples' rendered prompts differ in length from the billed prompt "
            "(rendered %d vs billed %d tokens); see %s",
            total_audit["prompt_billed_samples"] - total_audit["prompt_equal_samples"],
            total_audit["prompt_billed_samples"],
            total_audit["prompt_tokens"],
            total_audit["billed_prompt_tokens"],
            out_dir / "audit.md",
        )
    total = cost[-1] if cost else {}
    log.info(
        "reports: %d datasets, %d responses, $%s, %d throughput buckets, written to %s",
        sum(r["kind"] != "total" for r in rows),
        (total.get("responses_ok") or 0) + (total.get("responses_failed") or 0),
        format_usd(total.get("cost_usd") or 0.0),
        len(throughput),
        out_dir,
    )
    return {"tally": rows, "rejects": rejects, "cost": cost, "throughput": throughput, "limits": limits, "audit": audit}
