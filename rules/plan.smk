# Extraction plan, before extract (a checkpoint: extract jobs are made only once it has run; extract_input):
# storage and GPU hours per merged shard and in total for the configured layout, with alternatives (cap at N
# tokens, drop a dataset). Throughput: plan.tokens_per_s_per_gpu, or measured on the start of the first merged
# shard with the extract settings (then the job holds GPUs). The held-out set (merge.heldout > 0) is extracted
# too: its file is an input and its tokens are in the totals.


checkpoint plan:
    input:
        manifest="results/merged/manifest.json",
        merged=expand("results/merged/{k}.parquet", k=MERGED_SHARDS),
        heldout=heldout_merged(),
        target=target_input(),
    output:
        md="results/reports/plan.md",
        html=report("results/reports/plan.html", caption="../report/plan.rst", category="3. Extraction plan"),
        json="results/reports/plan.json",
    log:
        "logs/plan.log",
    resources:
        gpu=0 if PLAN.tokens_per_s_per_gpu else EXTRACT.gpus_per_job,
    params:
        model_path=TARGET["path"],
        extract=PLAN.extract_params(),
        plan=PLAN.params(),
        overflow=PLAN.overflow,
    script:
        "../scripts/plan.py"
