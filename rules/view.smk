# Loss-mask view (report): a few validated samples per dataset, spread over their lengths, with their supervised
# tokens (loss mask 1) marked, as HTML pages that `snakemake --report` shows in its page. One job for every
# dataset (one rule-graph node). Any other sample: python -m eagle3_data.view <parquet> --sample ID.


rule view:
    input:
        validated=validated_files(DATASETS),
        target=target_input(),
    output:
        pages=[
            report(
                f"results/reports/view/{ds}.html",
                caption="../report/view.rst",
                category="4. Loss-mask view",
                labels={"dataset": ds},
            )
            for ds in DATASETS
        ],
    log:
        "logs/view.log",
    conda:
        "../envs/cpu.yaml"
    params:
        validated={ds: validated_files([ds]) for ds in DATASETS},
        target={"path": TARGET["path"], "trust_remote_code": bool(TARGET.get("trust_remote_code", False))},
        examples=3,
        context=256,  # context runs longer than 2 x 256 tokens are shortened to their first and last 256
    script:
        "../scripts/view.py"
