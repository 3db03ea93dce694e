# Draft vocabulary: token frequencies over supervised tokens of the merged shards (DuckDB) and the
# SpecForge-convention d2t/t2d map for vocab.draft_vocab_size (padded when the corpus has fewer ids). The
# training set's: the held-out set (merge.heldout) is not in the merged shards and is not read.


rule vocab:
    input:
        merged=expand("results/merged/{k}.parquet", k=MERGED_SHARDS),
        target=target_input(),
    output:
        mapping="results/vocab/vocab_mapping.pt",
        freq="results/vocab/token_frequencies.parquet",
        summary="results/vocab/vocab.json",
    log:
        "logs/vocab.log",
    conda:
        "../envs/cpu.yaml"
    params:
        **VocabSettings.from_config(config).params(),  # draft_vocab_size, model_path
    script:
        "../scripts/vocab.py"
