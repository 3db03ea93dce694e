# Export: one extract file -> the per-sample files a trainer reads (SpecForge data_{i}.ckpt, speculators
# hs_{i}.safetensors), named by the sample's global index in the merged set. The per-shard JSON (written
# last) is the rule's output; the sample files go to results/export/<layout>/.


rule export:
    input:
        hidden="results/hidden_states/{k}.safetensors",
        manifest="results/merged/manifest.json",
    output:
        "results/export/{layout}/{k}.json",
    params:
        settings=config.get("export") or {},
        out_dir=lambda wc: f"results/export/{wc.layout}",
    wildcard_constraints:
        layout="specforge|speculators",
    log:
        "logs/export/{layout}/{k}.log",
    script:
        "../scripts/export.py"
