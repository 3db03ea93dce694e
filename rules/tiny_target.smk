# A tiny random-weight target with a Kimi-style tokenizer and chat template, built from a seed (never downloaded).

if TARGET.get("build_tiny"):

    rule tiny_target:
        output:
            directory(TARGET["path"]),
        log:
            "logs/tiny_target.log",
        conda:
            "../envs/cpu.yaml"
        params:
            tiny=TinyTargetSettings.from_config(config).params(),
        script:
            "../scripts/tiny_target.py"
