# Export: one merged shard (the shuffled order) -> the per-sample files a trainer reads (SpecForge EAGLE-3, DFlash
# and DSpark data_{i}.ckpt, speculators hs_{i}.safetensors in the extract dtype or FP8, Model-Optimizer {i}.pt;
# speculators_inplace, specforge_inplace, modelopt_inplace: no states copied, the trainer reads
# results/hidden_states/ through this package's backend, feature store, streaming dataset;
# eagle3_data.export.CONTRACTS), named by the sample's global index in the merged set and read from the
# hidden-states files of the selections the shard's rows came from. The per-shard JSON (written last) is the rule's
# output; the sample files go to results/export/<layout>/. No extract setting is a param: the states files are
# inputs, so a change of export.layouts never reruns an extract job.


rule export:
    input:
        merged="results/merged/{k}.parquet",
        manifest="results/merged/manifest.json",
        # an in-place layout reads no states: it is written before extraction ends (eagle3_data.export.inplace)
        states=lambda wc: [] if wc.layout in INPLACE_LAYOUTS else states_files(MERGE_DATASETS),
        provenance=rules.provenance.output.table,  # speculators' side table: each sample's provenance
    output:
        "results/export/{layout}/{k}.json",
    log:
        "logs/export/{layout}/{k}.log",
    wildcard_constraints:
        layout=EXPORT_LAYOUT_PATTERN,
    conda:
        "../envs/cpu.yaml"
    params:
        **EXPORT.params(),  # group_size
        out_dir=lambda wc: f"results/export/{wc.layout}",
    script:
        "../scripts/export.py"


# The held-out set (merge.heldout > 0; rule all asks for it only then): the same layout, indices from 0, in
# results/export/heldout/<layout>/, beside the training directories and never under them (SpecForge reads every
# *.ckpt under its --train-hidden-states-path; point --eval-hidden-states-path here). Its own JSON is the output.


rule export_heldout:
    input:
        merged=HELDOUT_MERGED,
        manifest="results/merged/manifest.json",
        states=lambda wc: [] if wc.layout in INPLACE_LAYOUTS else states_files(MERGE_DATASETS),
        provenance=rules.provenance.output.table,
    output:
        "results/export/heldout/{layout}.json",
    log:
        "logs/export/heldout/{layout}.log",
    wildcard_constraints:
        layout=EXPORT_LAYOUT_PATTERN,
    conda:
        "../envs/cpu.yaml"
    params:
        **EXPORT.params(),  # group_size
        out_dir=lambda wc: f"results/export/heldout/{wc.layout}",
        heldout=True,
    script:
        "../scripts/export.py"


# speculators trains on a data directory: a Hugging Face `datasets` directory (input_ids, loss_mask, seq_len) beside
# hidden_states/hs_{i}.safetensors, and token_freq.pt for its draft vocabulary (the training set's, in both). Written
# once every shard of the set is exported (eagle3_data.export.write_speculators_dataset), so
# `speculators train --data-path results/export/speculators` reads the export as it is (speculators_fp8: the same,
# with --hidden-states-backend fp8).
rule export_dataset:
    input:
        shards=expand("results/export/{{layout}}/{k}.json", k=MERGED_SHARDS),
        token_frequencies=rules.vocab.output.freq,
    output:
        files=[f"results/export/{{layout}}/{name}" for name in SPECULATORS_DATASET_FILES],
        token_freq="results/export/{layout}/token_freq.pt",
    log:
        "logs/export/{layout}/dataset.log",
    wildcard_constraints:
        layout=SPECULATORS_LAYOUT_PATTERN,
    conda:
        "../envs/cpu.yaml"
    script:
        "../scripts/export_dataset.py"


use rule export_dataset as export_dataset_heldout with:
    input:
        shards="results/export/heldout/{layout}.json",
        token_frequencies=rules.vocab.output.freq,
    output:
        files=[f"results/export/heldout/{{layout}}/{name}" for name in SPECULATORS_DATASET_FILES],
        token_freq="results/export/heldout/{layout}/token_freq.pt",
    log:
        "logs/export/heldout/{layout}-dataset.log",


# SpecForge reads the states in place (layout specforge_inplace): its ref manifest (SpecForge's disaggregated offline
# format: one SampleRef per sample, in the merged order, pointing at results/hidden_states/) and manifest.json.done,
# written once every shard's side table is (eagle3_data.export.inplace_specforge): from the merge alone, before
# extraction ends. Train with DISAGG_BACKEND=eagle3_data DISAGG_MANIFEST=<this file> python -m
# eagle3_data.export.inplace_specforge train ...
rule export_refs:
    input:
        shards=expand("results/export/{{layout}}/{k}.json", k=MERGED_SHARDS),
    output:
        manifest="results/export/{layout}/manifest.json",
        done="results/export/{layout}/manifest.json.done",
    log:
        "logs/export/{layout}/refs.log",
    wildcard_constraints:
        layout=REFS_LAYOUT_PATTERN,
    conda:
        "../envs/cpu.yaml"
    script:
        "../scripts/export_refs.py"


use rule export_refs as export_refs_heldout with:
    input:
        shards="results/export/heldout/{layout}.json",
    output:
        manifest="results/export/heldout/{layout}/manifest.json",
        done="results/export/heldout/{layout}/manifest.json.done",
    log:
        "logs/export/heldout/{layout}-refs.log",
