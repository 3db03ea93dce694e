"""The validate stage's shard-level verdicts: the count audits of a shard's validated rows (completion tokens
reconstructed vs billed, prompt tokens rendered vs billed) and the ceilings that fail the shard
(``validate.max_reject_rate``, ``validate.count_tolerance.aggregate_rel``); the row checks are in ``validate.py``."""

from __future__ import annotations

import logging

import pyarrow as pa
import pyarrow.compute as pc

from .errors import ExpectedFailure

log = logging.getLogger("eagle3_data.validate")


class RejectRateExceeded(ExpectedFailure, RuntimeError):
    """A shard rejected more than ``validate.max_reject_rate`` of its samples."""


class CountAuditFailed(ExpectedFailure, RuntimeError):
    """The shard's reconstructed completion tokens differ from the billed ones by more than ``aggregate_rel``."""


def count_audits(validated: pa.Table) -> dict:
    """The count audits' keys of :func:`validate`'s summary: completion tokens billed vs reconstructed (over the
    rows with a billed count) and the prompt audit (reported, never a reject): the prompt as the target template
    renders it vs what the backend billed; a gap means the server saw another prompt than the one the hidden
    states will be computed on."""
    has_billed = pc.is_valid(validated.column("billed_completion_tokens"))
    billed = int(pc.sum(pc.filter(validated.column("billed_completion_tokens"), has_billed)).as_py() or 0)
    recon = int(pc.sum(pc.filter(validated.column("num_completion_tokens"), has_billed)).as_py() or 0)
    bp = validated.column("billed_prompt_tokens")
    has_bp = pc.is_valid(bp)
    differ = pc.fill_null(pc.not_equal(bp, validated.column("num_prompt_tokens")), False)
    return {
        "billed_completion_tokens": billed,
        "reconstructed_completion_tokens": recon,
        "count_rel": abs(recon - billed) / billed if billed else 0.0,
        "billed_prompt_tokens": int(pc.sum(pc.filter(bp, has_bp)).as_py() or 0),
        "rendered_prompt_tokens": int(pc.sum(pc.filter(validated.column("num_prompt_tokens"), has_bp)).as_py() or 0),
        "prompt_samples_billed": int(pc.sum(pc.cast(has_bp, pa.int64())).as_py() or 0),
        "prompt_samples_differ": int(pc.sum(pc.cast(differ, pa.int64())).as_py() or 0),
    }


def warn_prompt_audit(tokens_path: str, summary: dict) -> None:
    """Log a warning when some validated samples' rendered prompt lengths differ from the billed ones."""
    if summary["prompt_samples_differ"]:
        log.warning(
            "validate %s: prompt audit: %d of %d samples' prompts as the target template renders them "
            "differ in length from the backend's billed prompt_tokens (%d rendered vs %d billed in all): "
            "the server may render another prompt (a default system prompt, another template version, "
            "tools rendered differently); see results/reports/audit.md",
            tokens_path,
            summary["prompt_samples_differ"],
            summary["prompt_samples_billed"],
            summary["rendered_prompt_tokens"],
            summary["billed_prompt_tokens"],
        )


def raise_over_ceilings(
    tokens_path: str, summary: dict, bad: list[dict], ceiling: float, aggregate_rel: float | None
) -> None:
    """Raise :class:`RejectRateExceeded` when the reject rate is above ``ceiling`` (``validate.max_reject_rate``)
    and :class:`CountAuditFailed` when ``count_rel`` is above ``aggregate_rel`` (when set)."""
    n = summary["rows"]
    rate = len(bad) / n if n else 0.0
    if rate > ceiling:
        examples = "; ".join(f"{b['sample_id']}: {b['reason']} ({b['detail'][:80]})" for b in bad[:5])
        unpaid = summary["failed_unpaid"]
        raise RejectRateExceeded(
            f"{tokens_path}: {len(bad)}/{n} samples rejected ({rate:.1%}) > validate.max_reject_rate "
            f"{ceiling:.1%}; reasons {summary['rejected']}; e.g. {examples}"
            + (
                f"; {unpaid} failed, not paid: rerun to retry them (`snakemake --forcerun generate` sends only those "
                "samples: they were recorded as failed with generation.unpaid_failures: keep)"
                if unpaid
                else ""
            )
        )
    count_rel = summary["count_rel"]
    if aggregate_rel is not None and count_rel > aggregate_rel:
        raise CountAuditFailed(
            f"{tokens_path}: reconstructed completion tokens {summary['reconstructed_completion_tokens']} vs billed "
            f"{summary['billed_completion_tokens']} differ by {count_rel:.4%} > "
            f"validate.count_tolerance.aggregate_rel {aggregate_rel:.4%} (the provider may "
            f"trim or alter the text it returns, or the template family is wrong)"
        )
