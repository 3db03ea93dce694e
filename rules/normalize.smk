# Stage 1: public source file -> prompts shards (+ normalize rejects). One job per dataset reads its source
# once and writes every shard; shard = hash(sample_id) mod shards. Pre-tokenized (A-type) sources go straight
# to tokens shards and join the other datasets at validate.

for _ds in DATASETS:

    rule:
        name:
            f"normalize_{_ds}"
        input:
            source=config["datasets"][_ds]["source"]["path"],
        output:
            shards=[f"results/{_ds}/{'tokens' if _ds in PRETOKENIZED else 'prompts'}/{s}.parquet" for s in shards(_ds)],
            rejects=f"results/{_ds}/rejected/normalize.parquet",
        log:
            f"logs/normalize/{_ds}.log",
        conda:
            "../envs/cpu.yaml"
        params:
            dataset=_ds,
            source=NormalizeSettings.from_config(config, _ds).params(),  # max_reject_rate is a check: not a param
            num_shards=len(shards(_ds)),
        script:
            "../scripts/normalize.py"
