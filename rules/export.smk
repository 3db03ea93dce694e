# Export: one merged shard (the shuffled order) -> the per-sample files a trainer reads (SpecForge
# data_{i}.ckpt, speculators hs_{i}.safetensors), named by the sample's global index in the merged set and
# read from the hidden-states files of the selections the shard's rows came from. The per-shard JSON
# (written last) is the rule's output; the sample files go to results/export/<layout>/.


rule export:
    input:
        merged="results/merged/{k}.parquet",
        manifest="results/merged/manifest.json",
        states=states_files(MERGE_DATASETS),
    output:
        "results/export/{layout}/{k}.json",
    params:
        **EXPORT.params(),  # group_size
        out_dir=lambda wc: f"results/export/{wc.layout}",
    wildcard_constraints:
        layout="specforge|speculators",
    log:
        "logs/export/{layout}/{k}.log",
    conda:
        "../envs/cpu.yaml"
    script:
        "../scripts/export.py"
