# Stage 6: one merge selection (the kept samples of one validated shard) -> the target's auxiliary + final
# hidden states (safetensors, no padding stored). The job re-runs only when the merge's digest of its
# selection changes (params), and then forwards only the samples it cannot reuse (see
# src/eagle3_data/extract/stage.py). `resources: gpu` caps concurrent extraction: `--resources gpu=8` keeps at
# most 8 devices busy.


rule extract:
    input:
        unpack(extract_input),
    output:
        states="results/hidden_states/{ds}/{shard}.safetensors",
        summary="results/hidden_states/{ds}/{shard}.json",
    log:
        "logs/extract/{ds}/{shard}.log",
    resources:
        gpu=EXTRACT.gpus_per_job,
    params:
        selection=selection_digest,
        model_path=TARGET["path"],
        states=EXTRACT.params(),
    script:
        "../scripts/extract.py"
