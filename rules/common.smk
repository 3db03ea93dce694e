# Config validation, dataset lists, input functions and wildcard constraints shared by every stage.

import os
import re
import sys
from pathlib import Path

from eagle3_data import config as cfg
from eagle3_data import settings as stage_settings
from eagle3_data.config.commands import runs_no_job
from eagle3_data.gguf_target import gguf_file
from eagle3_data.runtime import damaged, owner
from eagle3_data.settings import (
    DecontaminateSettings,
    ExportSettings,
    ExtractSettings,
    GGUFTargetSettings,
    MergeSettings,
    NormalizeSettings,
    PlanSettings,
    TargetSettings,
    TinyTargetSettings,
    TokenizeSettings,
    ValidateSettings,
    VocabSettings,
)


def _dry_run() -> bool:
    return bool(getattr(getattr(workflow, "output_settings", None), "dryrun", False))


def _check_config():
    """Schema (filling in defaults), layering, cross-key and API-key checks, before any job runs.

    A problem ends the run with a few lines naming the file and key (no traceback, no schema dump). The API
    key variables are checked for the datasets that still have responses to generate; a dry run (-n) only
    warns about them, so `snakemake -n` works before the key is exported; a mode that runs no job (`--report`,
    `--summary`, ...: eagle3_data.config.commands) does not check them. A dataset whose results/<name>/ was built
    for another target is refused (eagle3_data.runtime.owner). A damaged stage output under results/ is named and
    removed, so this run rebuilds it (eagle3_data.runtime.damaged; a dry run only names it). Returns the config
    files, (path, parsed YAML) in merge order.
    """
    main = workflow.is_main_process
    embedded = os.path.relpath(Path(workflow.basedir) / "config.yaml")
    try:
        files = cfg.config_sources(workflow.overwrite_configfiles, default=embedded)  # (a key set twice: refused)
        if main:
            cfg.check_layering(files)
        cfg.validate_config(config, cfg.schema(), files=files)
        cfg.check_config(config)
        if main and not runs_no_job(sys.argv):
            # a damaged stage output (a parquet cut in half, 0 bytes): named, removed, rebuilt by this run
            for line in damaged.remove_damaged("results", dry_run=_dry_run()):
                print(line, file=sys.stderr)
            # a dataset built for another target: refused, alone
            owner.check(cfg.datasets(config), files, config["target"]["path"])
        chosen = cfg.resolve_target_template(config)  # target.template: auto -> the family (cached)
        if main and chosen:
            print(chosen, file=sys.stderr)
        if main:  # what would otherwise fail after paying: the target's tokenizer, draft vocab, launch.python, SLURM
            from eagle3_data.runtime import prerun

            prerun.check_before_run(config, cache_dir=config.get("cache_dir", "cache"), workflow=workflow)
        # the API keys: not for --lint, --unlock, --report and the other modes that run no job (send no request)
        if main and getattr(workflow, "check_envvars", True) and not runs_no_job(sys.argv):
            try:
                cfg.check_api_keys(config, cfg.pending_generation(config))
            except cfg.ConfigError as exc:
                if not _dry_run():
                    raise
                print(f"Warning (dry run): {exc}", file=sys.stderr)
    except cfg.ConfigError as exc:
        print(exc, file=sys.stderr)
        sys.exit(1)
    return files


# A kill -9 left Snakemake's lock: say how to go on, in one line, before anything else (the config checks included);
# a command the lock would stop ends there (eagle3_data.runtime.run.stale_lock_stops)
from eagle3_data.runtime import run as run_state

if workflow.is_main_process and "--unlock" not in sys.argv and not _dry_run():
    _hint = run_state.stale_lock_hint(config.get("cache_dir", "cache"))
    if _hint:
        print(_hint, file=sys.stderr, flush=True)
        if run_state.stale_lock_stops(sys.argv):  # the lock would stop it: the hint is all it prints
            sys.exit(1)


CONFIG_FILES = _check_config()  # (path, parsed YAML) of each config file, in merge order

DATASETS = cfg.datasets(config)
GENERATED = cfg.generated_datasets(config)  # they send requests (rule generate)
ORIGINAL = cfg.original_datasets(config)  # answers: original (rule original_answers, no request)
RESPONDED = cfg.response_datasets(config)  # both: a responses shard each, then tokenize and validate
PRETOKENIZED = cfg.pretokenized_datasets(config)
MERGE_DATASETS = cfg.merge_datasets(config)
MERGED_SHARDS = cfg.merged_shard_names(config)
EXPORT = ExportSettings.from_config(config)
EXPORT_LAYOUTS = EXPORT.layouts
from eagle3_data.export import INPLACE_LAYOUTS, LAYOUTS, REFS_LAYOUTS, SPECULATORS_DATASET_FILES, SPECULATORS_LAYOUTS

EXPORT_LAYOUT_PATTERN = "|".join(LAYOUTS)
SPECULATORS_LAYOUT_PATTERN = "|".join(SPECULATORS_LAYOUTS)
REFS_LAYOUT_PATTERN = "|".join(REFS_LAYOUTS)


def speculators_datasets():
    """The data-directory files of every requested speculators layout (rule export_dataset), and of the held-out
    set's with merge.heldout > 0."""
    layouts = [x for x in EXPORT_LAYOUTS if x in SPECULATORS_LAYOUTS]
    sets = ["results/export/{layout}"] + (["results/export/heldout/{layout}"] if MERGE.heldout else [])
    return [
        os.path.join(f.format(layout=x), name)
        for f in sets
        for x in layouts
        for name in list(SPECULATORS_DATASET_FILES) + ["token_freq.pt"]
    ]


def ref_manifests():
    """The SpecForge ref manifest of every requested specforge_inplace layout (rule export_refs), and of the
    held-out set's with merge.heldout > 0."""
    sets = ["results/export/{layout}"] + (["results/export/heldout/{layout}"] if MERGE.heldout else [])
    return [
        os.path.join(f.format(layout=x), "manifest.json") for f in sets for x in EXPORT_LAYOUTS if x in REFS_LAYOUTS
    ]


TARGET = config["target"]
# each stage's settings, built once from the validated config (defaults: the schema's); rule params are their
# content keys (params()), so a change reruns exactly the rules whose output depends on it
MERGE = MergeSettings.from_config(config)
EXTRACT = ExtractSettings.from_config(config)
PLAN = PlanSettings.from_config(config)
VALIDATE = ValidateSettings.from_config(config)
FORECAST = cfg.section(config, "forecast")
CACHE_DIR = config["cache_dir"]
# decontamination (rules minhash, decontaminate, decontamination_report: rules/decontaminate.smk), on when benchmarks
# are listed or near-duplicates enabled; off, generate and original_answers read the normalized prompts as before
DECONTAMINATE = DecontaminateSettings.from_config(config)
PROMPT_DATASETS = [ds for ds in DATASETS if ds not in PRETOKENIZED]  # config order: near-duplicates keep the first
#: what generate, original_answers and the forecast read: the prompts kept by decontaminate, else normalize's
GENERATION_PROMPTS = (
    "results/{ds}/decontaminated/{shard}.parquet" if DECONTAMINATE.on else "results/{ds}/prompts/{shard}.parquet"
)

# The run's state (launched servers) lives under CACHE_DIR/runs/ and reaches the jobs through the environment: the
# Snakefile's onstart begins it (so `snakemake -n` and --lint change nothing), its onsuccess/onerror hooks end it
# (eagle3_data.runtime.run; imported above as run_state).
if workflow.remote_exec:  # a cluster job: the backends' max_concurrency is split over the jobs that use them
    os.environ.setdefault("EAGLE3_CONCURRENCY", "split")

# Generate-job seats per backend (one machine): a generate job takes a seat of each backend its dataset uses, so one
# backend's shards never fill every `generate_jobs` seat while another backend idles (cfg.backend_job_seats).
GENERATE_JOBS = getattr(workflow.global_resources.get("generate_jobs"), "value", None)  # profiles/default: 32
SEATS = (
    cfg.backend_job_seats(config, GENERATE_JOBS)
    if isinstance(GENERATE_JOBS, int) and not workflow.non_local_exec
    else {}
)
for _backend, _seats in SEATS.items():
    workflow.register_resource(cfg.seat_resource(_backend), _seats)


def seat_resources():
    """Rule resources: one seat of each backend the job's dataset uses (``generate_jobs_<backend>``)."""
    return {cfg.seat_resource(b): (lambda wc, b=b: int(b in cfg.backends_config(config, wc.ds))) for b in SEATS}


def _alternation(names):
    return "|".join(re.escape(n) for n in names) if names else "(?!x)x"


wildcard_constraints:
    ds=_alternation(DATASETS),
    shard=r"\d{3}",
    k=r"\d{3}",


def shards(ds):
    return cfg.shard_names(config, ds)


def target_input():
    """The target directory, when the build makes it (tiny target, GGUF target), so a rebuild reruns what uses it."""
    return [TARGET["path"]] if TARGET.get("build_tiny") or TARGET.get("gguf") else []


def validated_files(datasets):
    return [f"results/{ds}/validated/{s}.parquet" for ds in datasets for s in shards(ds)]


def rejected_files(datasets):
    out = [f"results/{ds}/rejected/normalize.parquet" for ds in datasets]
    return (
        out
        + decontaminate_rejects(datasets)
        + [f"results/{ds}/rejected/{s}.parquet" for ds in datasets for s in shards(ds)]
    )


def decontaminate_rejects(datasets):
    """Rule decontaminate's rejects of ``datasets`` (their prompt shards), none when the stage is off."""
    if not DECONTAMINATE.on:
        return []
    return [
        f"results/{ds}/rejected/decontaminate/{s}.parquet"
        for ds in datasets
        if ds in PROMPT_DATASETS
        for s in shards(ds)
    ]


def decontaminated_files(datasets):
    """Rule decontaminate's kept prompts of ``datasets``, none when the stage is off."""
    if not DECONTAMINATE.on:
        return []
    return [f"results/{ds}/decontaminated/{s}.parquet" for ds in datasets if ds in PROMPT_DATASETS for s in shards(ds)]


def generation_prompts(datasets):
    """The prompts shards generate (or original_answers, the forecast) reads for ``datasets``."""
    return [GENERATION_PROMPTS.format(ds=ds, shard=s) for ds in datasets for s in shards(ds)]


def benchmark_files():
    """The benchmark files decontaminate.benchmarks names (rule decontaminate's inputs; checked before any job)."""
    from eagle3_data.decontaminate import benchmark_inputs

    return benchmark_inputs(DECONTAMINATE)


def prompts_files(datasets):
    """Normalize's prompts shards of ``datasets`` (those with prompts: not pre-tokenized)."""
    return [f"results/{ds}/prompts/{s}.parquet" for ds in datasets if ds in PROMPT_DATASETS for s in shards(ds)]


def provenance_datasets():
    """Rule provenance's per-dataset params: the source file and format, and the generation settings the requests
    were sent with (None for answers: original and pre-tokenized datasets: nothing was sent)."""
    return {
        ds: {
            "source_path": config["datasets"][ds]["source"]["path"],
            "source_format": config["datasets"][ds]["source"]["format"],
            "generation": stage_settings.generation_data_settings(config, ds) if ds in GENERATED else None,
        }
        for ds in MERGE_DATASETS
    }


def provenance_backends():
    """Rule provenance's per-backend params: type (the engine), model, extra_body."""
    return {
        name: {k: (b or {}).get(k) for k in ("type", "model", "extra_body")}
        for name, b in (config.get("backends") or {}).items()
    }


def earlier_datasets(ds):
    """The datasets with prompts listed before ``ds`` (near-duplicates: the first in this order is kept), less
    another mode of its own source (eagle3_data.config.lookup.earlier_prompt_datasets), then ``ds`` itself when
    near-duplicates are looked for within a dataset too; none when near-duplicates are off."""
    if not DECONTAMINATE.near_on:
        return []
    return cfg.earlier_prompt_datasets(config, ds) + ([ds] if DECONTAMINATE.within_on else [])


def earlier_signatures(ds):
    """The MinHash signature files of every shard of :func:`earlier_datasets` of ``ds``."""
    return [f"results/{e}/minhash/{s}.parquet" for e in earlier_datasets(ds) for s in shards(e)]


def selection_path(ds, shard):
    return f"results/merged/selection/{ds}/{shard}.parquet"


def selection_files(datasets):
    """Merge selections, one per validated shard, in validated_files() order."""
    return [selection_path(ds, s) for ds in datasets for s in shards(ds)]


HELDOUT_MERGED = "results/merged/heldout.parquet"


def heldout_merged_output():
    """Rule merge's held-out output, only when merge.heldout > 0 (off, the DAG is as without the split)."""
    return {"heldout": HELDOUT_MERGED} if MERGE.heldout else {}


def heldout_prompt_files():
    """The prompts files the held-out draw reads (their prompt_key), when merge.heldout > 0, else ``[]``."""
    if not MERGE.heldout:
        return []
    return [f"results/{ds}/prompts/{s}.parquet" for ds in MERGE_DATASETS if ds not in PRETOKENIZED for s in shards(ds)]


def heldout_merged():
    """The held-out merged file as an input list: ``[HELDOUT_MERGED]`` when merge.heldout > 0, else ``[]``."""
    return list(heldout_merged_output().values())


def states_files(datasets):
    return [f"results/hidden_states/{ds}/{s}.safetensors" for ds in datasets for s in shards(ds)]


def extract_input(wildcards):
    """The selection to forward, once the merge checkpoint has run. ancient(): a merge that rewrites the file
    with the same rows must not rerun the job; a changed selection does, through its digest in params."""
    checkpoints.merge.get()
    # the plan first (a checkpoint): no extract job exists before plan.md is written and its one-line summary
    # printed, so `--until plan` stops before any GPU extracts; the plan's file is no input (a rewritten plan
    # reruns no extraction)
    checkpoints.plan.get()
    return {"selection": ancient(selection_path(wildcards.ds, wildcards.shard)), "target": target_input()}


def selection_digest(wildcards):
    """The merge's digest of this selection (manifest.json), so a changed selection reruns its extract job."""
    manifest = checkpoints.merge.get().output.manifest
    return cfg.selection_digest(manifest, f"{wildcards.ds}/{wildcards.shard}")


def responses_files(datasets):
    return [f"results/{ds}/responses/{s}.parquet" for ds in datasets if ds in RESPONDED for s in shards(ds)]


def start_run_view():
    """Snakefile ``onstart``: the run-wide generation view on the console (eagle3_data.runtime.runview)."""
    run = run_state.current()
    if run is not None and not workflow.non_local_exec:
        from eagle3_data.runtime import runview

        runview.start(config, run.dir)


def print_run_summary(ok):
    """The run's last lines: per dataset done, failed, not sent, rejected, kept, cost and time."""
    from eagle3_data.runtime import runview
    from eagle3_data.report import run_summary

    runview.stop()  # the live table's last state first, then the summary below it, not under a redrawn table
    try:
        run = run_state.current()
        text = run_summary(
            config["datasets"],
            "results",
            run_s=run_state.elapsed(),
            ok=ok,
            tally_path="results/reports/tally.md",
            run_dir=run.dir if run is not None else None,
            decontaminated=DECONTAMINATE.on,
        )
    except Exception as exc:  # a damaged file must not keep the end-of-run hook from stopping the servers
        text = f"(no run summary: {type(exc).__name__}: {exc})"
    print(f"\n{text}", file=sys.stderr)
