"""What a change of each config key reruns (:data:`RERUNS`, the source of the table in docs/config.md)."""

from __future__ import annotations


_BELOW_MERGE = "merge; extract where a selection's samples change; export, plan, vocab"
_GEN_CHAIN = (
    "generate of the datasets using it (only requests the journal lacks are sent), then their tokenize "
    "and validate, report, view, " + _BELOW_MERGE
)
_DS_CHAIN = "the dataset's own chain (normalize, generate or original_answers onward), report, view, " + _BELOW_MERGE
#: what a generation key reruns for an ``answers: original`` dataset that only generated datasets' requests read
_NOT_ORIGINAL = "; nothing for a dataset with answers: original"
NOTHING = "nothing"
#: For every config key, what changing it reruns (leaves: the key; ``*`` covers every key under a prefix). The
#: table in docs/config.md is rendered from this (eagle3_data.config.docgen); tests/unit/test_config.py checks every schema
#: key has an entry and tests/workflow/test_workflow.py checks the claims with dry runs of the demo build. With
#: ``merge.heldout`` > 0, rule ``export_heldout`` reruns wherever ``export`` does.
RERUNS: list[tuple[str, str]] = [
    (
        "cache_dir",
        NOTHING + " (move the directory with it: it holds the journals, the extraction links and what "
        "the forecast pilot saw)",
    ),
    (
        "target.name",
        "generate of every generated dataset (the journal is keyed by the target: new requests), "
        "tokenize, validate, report, view, " + _BELOW_MERGE,
    ),
    (
        "target.path",
        "tokenize, validate (the tokenizer), report, view, " + _BELOW_MERGE + " (every selection: another "
        "checkpoint; rows are reused only if its weights are the same); generate only for "
        "native_generate backends",
    ),
    ("target.build_tiny", "tiny_target, then as target.path"),
    ("target.trust_remote_code", "tokenize, validate, report, view, " + _BELOW_MERGE),
    (
        "target.template",
        "generate of every generated dataset (the request history depends on the family: Kimi "
        "tool-call ids, reasoning on tool-call turns; the journal answers every request whose prompt "
        "is unchanged; original_answers only where the form of history tool-call ids changes, Kimi "
        "or not), tokenize, validate, report, view, " + _BELOW_MERGE,
    ),
    ("target.chat_template_kwargs", "as target.template"),
    ("target.tiny.*", "tiny_target (the demo's target), then everything that reads it"),
    (
        "target.gguf.file",
        "gguf_target (the GGUF file is its input), then everything that reads the target (the "
        "journal answers the requests it holds: a new target.name sends them again)",
    ),
    ("target.gguf.package", "as target.gguf.file"),
    ("target.gguf.generation_config", "gguf_target (its params), then as target.gguf.file"),
    ("backends.<name>.type", _GEN_CHAIN),
    ("backends.<name>.base_url", "as backends.<name>.type"),
    ("backends.<name>.model", "as backends.<name>.type"),
    ("backends.<name>.extra_body", "as backends.<name>.type"),
    ("backends.<name>.provider", "as backends.<name>.type"),
    ("backends.<name>.reasoning", "as backends.<name>.type"),
    ("backends.<name>.native_generate", "as backends.<name>.type"),
    ("backends.<name>.cost_lookup", "as backends.<name>.type"),
    (
        "backends.<name>.return_token_ids",
        "generate of the datasets using it (replies the journal already holds keep "
        "what they had: no ids), then their tokenize and validate, report, view, " + _BELOW_MERGE,
    ),
    ("backends.<name>.api_key_env", NOTHING),
    ("backends.<name>.max_concurrency", NOTHING),
    ("backends.<name>.max_jobs", NOTHING),
    ("backends.<name>.timeout_s", NOTHING),
    ("backends.<name>.requests_per_minute", NOTHING),
    ("backends.<name>.tokens_per_minute", NOTHING),
    ("backends.<name>.headers", NOTHING),
    ("backends.<name>.cost_lookup_delay_s", NOTHING),
    ("backends.<name>.down_after_s", NOTHING),
    ("backends.<name>.price_per_m.*", "forecast (its dollars; the pilot is not sent again)"),
    ("backends.<name>.launch.*", NOTHING + " (adding or removing launch: as base_url)"),
    (
        "generation.backends",
        "generate of the datasets that don't set their own (only requests the journal lacks "
        "are sent), then as backends.<name>.type",
    ),
    (
        "generation.mode",
        "generate (original_answers for a dataset with answers: original) of the datasets that "
        "don't set their own (new requests), then " + _DS_CHAIN,
    ),
    (
        "generation.max_tokens",
        "generate of the datasets that don't set their own (new requests), then " + _DS_CHAIN + _NOT_ORIGINAL,
    ),
    ("generation.temperature", "as generation.max_tokens"),
    ("generation.top_p", "as generation.max_tokens"),
    (
        "generation.extra_body",
        "as generation.max_tokens; for a dataset with answers: original only its "
        "chat_template_kwargs, which rerun its tokenize onward",
    ),
    (
        "generation.max_samples",
        "generate (original_answers for a dataset with answers: original) of the datasets "
        "that don't set their own (a larger cap sends only the new requests), then " + _DS_CHAIN,
    ),
    (
        "generation.budget_completion_tokens",
        "generate of the datasets that don't set their own (a larger budget "
        "sends only the new requests), then " + _DS_CHAIN + _NOT_ORIGINAL,
    ),
    ("generation.budget_usd", "as generation.budget_completion_tokens"),
    (
        "generation.max_retries",
        NOTHING + " (a shard whose samples failed without a paid reply reruns by itself: generation.unpaid_failures)",
    ),
    (
        "generation.unpaid_failures",
        NOTHING + " (keep: `snakemake --forcerun generate` sends the samples recorded as failed without a paid reply)",
    ),
    ("generation.retry_initial_s", NOTHING),
    ("generation.retry_max_s", NOTHING),
    ("generation.stop_grace_s", NOTHING),
    ("generation.reject_other_models", "as generation.max_tokens"),
    (
        "generation.max_prompt_bytes",
        "generate of the datasets that don't set their own (a larger bound sends only the "
        "prompts it lets through), then " + _DS_CHAIN + _NOT_ORIGINAL,
    ),
    ("datasets.<name>.source.format", _DS_CHAIN),
    ("datasets.<name>.source.path", _DS_CHAIN),
    ("datasets.<name>.source.max_samples", _DS_CHAIN),
    ("datasets.<name>.source.options", _DS_CHAIN),
    ("datasets.<name>.source.max_reject_rate", NOTHING),
    ("datasets.<name>.source.on_error", _DS_CHAIN),
    ("datasets.<name>.source.duplicate_prompts", _DS_CHAIN),
    ("datasets.<name>.shards", _DS_CHAIN + " (every selection of the dataset is new: its states are recomputed)"),
    (
        "datasets.<name>.answers",
        "the dataset's responses (original_answers; back to regenerate: generate, which "
        "sends only the requests the journal lacks, none for answers it had bought before), "
        "its tokenize and validate, report, view, " + _BELOW_MERGE + "; never normalize "
        "or another dataset's jobs; cache/ is left as it is",
    ),
    ("datasets.<name>.generation.max_retries", NOTHING),
    ("datasets.<name>.generation.unpaid_failures", NOTHING),
    ("datasets.<name>.generation.retry_initial_s", NOTHING),
    ("datasets.<name>.generation.retry_max_s", NOTHING),
    ("datasets.<name>.generation.stop_grace_s", NOTHING),
    ("datasets.<name>.generation.*", "as generation.<key>, for that dataset only"),
    (
        "decontaminate.benchmarks",
        "decontaminate of every prompts shard (adding the first benchmark or removing the last "
        "turns the stage on or off), then generate or original_answers of the shards it "
        "reruns (the journal answers every request it paid for: only prompts newly let "
        "through are sent), their tokenize and validate, decontamination_report, report, "
        "view, " + _BELOW_MERGE + "; never normalize or minhash; a benchmark file's content "
        "is an input (a new version reruns the same)",
    ),
    ("decontaminate.ngram", "as decontaminate.benchmarks while benchmarks are listed; else " + NOTHING),
    ("decontaminate.min_shared_ngrams", "as decontaminate.ngram"),
    (
        "decontaminate.near_duplicates.enabled",
        "minhash and decontaminate of every prompts shard, then as decontaminate.benchmarks",
    ),
    (
        "decontaminate.near_duplicates.threshold",
        "as decontaminate.benchmarks while near_duplicates.enabled (the "
        "signatures are kept: no minhash); else " + NOTHING,
    ),
    ("decontaminate.near_duplicates.num_perm", "minhash, then as decontaminate.near_duplicates.threshold"),
    ("decontaminate.near_duplicates.shingle", "as decontaminate.near_duplicates.num_perm"),
    ("decontaminate.near_duplicates.seed", "as decontaminate.near_duplicates.num_perm"),
    ("decontaminate.near_duplicates.within_dataset", "as decontaminate.near_duplicates.threshold"),
    ("normalize.max_reject_rate", NOTHING),
    (
        "normalize.duplicate_prompts",
        "as datasets.<name>.source.duplicate_prompts, for every dataset that doesn't set its own",
    ),
    ("validate.max_reject_rate", NOTHING),
    ("validate.count_tolerance.aggregate_rel", NOTHING),
    ("validate.keep_truncated", "validate of every shard, report, view, " + _BELOW_MERGE),
    ("validate.count_tolerance.per_sample_abs", "as validate.keep_truncated"),
    ("validate.count_tolerance.per_sample_rel", "as validate.keep_truncated"),
    ("validate.max_tokens", "as validate.keep_truncated"),
    ("merge.datasets", _BELOW_MERGE),
    ("merge.max_samples", _BELOW_MERGE + " (a lower cap forwards nothing; a higher one only the samples added)"),
    (
        "merge.max_len",
        _BELOW_MERGE + " (a lower cap forwards nothing: a truncation's states are a prefix of the stored ones)",
    ),
    ("merge.overflow", _BELOW_MERGE),
    ("merge.seed", "merge, export, plan, vocab (no extraction: the selections are the same)"),
    ("merge.shards", "merge, export, plan, vocab (no extraction)"),
    (
        "merge.heldout",
        "merge, export, export_heldout, plan, vocab (no extraction: the held-out rows stay in the "
        "selections; only under a merge.max_samples cap, which counts training rows, extract where a "
        "selection's samples change)",
    ),
    ("merge.memory_mb", NOTHING),
    ("bounds.max_concurrency", NOTHING + " (a bound checked before any job runs)"),
    ("bounds.max_shards", NOTHING + " (a bound checked before any job runs)"),
    ("merge.threads", NOTHING),
    ("extract.backend", "extract (every selection; nothing reusable), export, plan"),
    ("extract.layers", "as extract.backend"),
    ("extract.dtype", "as extract.backend"),
    (
        "extract.final_norm",
        "as extract.backend (the default changed from post to both: a build made before "
        "extracts once more, unless its config names post or pre)",
    ),
    ("extract.final_states", "as extract.backend"),
    ("extract.aux_format", "as extract.backend"),
    ("extract.final_format", "as extract.backend"),
    (
        "extract.drafters",
        "as extract.backend (the union of the drafters' layers is stored: adding one adds its layers)",
    ),
    ("extract.dflash_layers", "as extract.backend, with dflash or dspark in extract.drafters; else nothing"),
    (
        "extract.fused",
        NOTHING + " (the kernels that compute the states; their values are the same to the last bit "
        "on the probe, else the module is not fused)",
    ),
    ("extract.gpus_per_job", "plan (wall hours)"),
    ("extract.device", NOTHING + " (plan, when it measures the throughput)"),
    ("extract.batch_tokens", NOTHING + " (plan, when it measures the throughput)"),
    ("extract.attention", NOTHING + " (plan, when it measures the throughput)"),
    ("extract.gpu_lock_dir", NOTHING),
    (
        "export.layouts",
        "export of the layouts added (and export_dataset for a speculators one), plan (its disk "
        "check; the throughput it measured is reused); never extract",
    ),
    ("export.group_size", "export"),
    ("plan.*", "plan"),
    ("forecast.pilot_samples", "forecast_pilot and forecast (a larger pilot sends only the samples the journal lacks)"),
    ("vocab.draft_vocab_size", "vocab"),
]


def reruns_of(key: str) -> str | None:
    """What changing config key ``key`` (a schema path such as ``backends.<name>.timeout_s``) reruns, from
    :data:`RERUNS` (exact entries before ``prefix.*`` ones); None when no entry covers it."""
    for k, v in RERUNS:
        if k == key:
            return v
    for k, v in RERUNS:
        if k.endswith(".*") and key.startswith(k[:-1]):
            return v
    return None
