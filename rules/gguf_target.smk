# A real target converted once from a GGUF file (target.gguf) into an ordinary transformers directory at target.path.
# Input: the GGUF file (a path, or a file inside an installed Python package); params: the conversion settings.

if TARGET.get("gguf"):

    rule gguf_target:
        input:
            gguf=str(gguf_file(TARGET["gguf"])),
        output:
            directory(TARGET["path"]),
        log:
            "logs/gguf_target.log",
        conda:
            "../envs/cpu.yaml"
        params:
            gguf=GGUFTargetSettings.from_config(config).params(),
        script:
            "../scripts/gguf_target.py"
