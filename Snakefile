# EAGLE-3 training-data build. Stages (one rule file each in rules/):
#   tiny_target or gguf_target -> normalize -> (decontaminate: benchmark overlaps, near-duplicates; when configured) ->
#   generate (or original_answers: a dataset's own answers) -> tokenize -> validate -> merge (+ provenance: where each
#   merged row came from) -> extract -> export (+ export_heldout with merge.heldout), report (+ view: loss-mask examples
#   for the report)
# merge is a checkpoint: extraction runs per validated shard and reruns only where the merge's selection
# of that shard changed. plan is one too: the extract jobs are made only once the plan is written.
# `snakemake --cores N` rebuilds only stale targets; see README.md.

from snakemake.utils import min_version

min_version("9.0")


# The embedded default. `--configfile other.yaml` replaces it (rather than being merged into it, which would
# keep the demo datasets); `--config key=value` still overrides single keys of it.
if not workflow.overwrite_configfiles:

    configfile: "config.yaml"


report: "report/workflow.rst"


include: "rules/common.smk"
include: "rules/tiny_target.smk"
include: "rules/gguf_target.smk"
include: "rules/normalize.smk"
include: "rules/decontaminate.smk"
include: "rules/generate.smk"
include: "rules/original_answers.smk"
include: "rules/tokenize.smk"
include: "rules/validate.smk"
include: "rules/merge.smk"
include: "rules/provenance.smk"
include: "rules/extract.smk"
include: "rules/plan.smk"
include: "rules/vocab.smk"
include: "rules/export.smk"
include: "rules/report.smk"
include: "rules/view.smk"
include: "rules/forecast.smk"


rule all:
    default_target: True
    input:
        hidden_states=states_files(MERGE_DATASETS),
        report=rules.report.output,
        provenance=rules.provenance.output.json,
        views=rules.view.output,
        plan=rules.plan.output.md,
        vocab=rules.vocab.output.mapping,
        exports=expand("results/export/{layout}/{k}.json", layout=EXPORT_LAYOUTS, k=MERGED_SHARDS),
        # the held-out set's exports, only with merge.heldout > 0
        heldout_exports=expand("results/export/heldout/{layout}.json", layout=EXPORT_LAYOUTS) if MERGE.heldout else [],
        # the decontamination report, only when the stage is on (decontaminate.benchmarks / near_duplicates)
        decontamination=rules.decontamination_report.output.md if DECONTAMINATE.on else [],
        # speculators' data directories (the `datasets` files beside hidden_states/)
        speculators_dataset=speculators_datasets(),
        # SpecForge's ref manifests of the in-place layout (specforge_inplace)
        ref_manifests=ref_manifests(),


onstart:
    run_state.begin(CACHE_DIR)  # the run's state: here, not at parse time, so a dry run or --lint changes nothing
    run_state.on_start(CACHE_DIR)
    owner.record(DATASETS, CONFIG_FILES, TARGET["path"])  # results/<dataset>/.built-by.json: its config, target
    start_run_view()
    # a worker per generate-job seat: generate jobs wait on their longest requests without a core (eagle3_data.runtime.run)
    if SEATS:
        run_state.widen_local_workers(workflow, GENERATE_JOBS)


onsuccess:
    print_run_summary(ok=True)
    run_state.end(CACHE_DIR, ok=True, datasets=GENERATED)


onerror:
    print_run_summary(ok=False)
    run_state.end(CACHE_DIR, ok=False, datasets=GENERATED)
