"""Test support shared by the test suite (``tests/``) and the benchmarks (``benchmarks/``), as ``numpy.testing``
or ``torch.testing`` ship with their packages: imported as ``eagle3_data.testing.<module>``, never by the rest of
``eagle3_data`` (tests/unit/test_package_layout.py checks that). Nothing is imported here; each module brings in
only what it uses, so that importing one needs no test extra it does not use.

- :mod:`.workflow` - the repository checkout, a scratch copy of the workflow, a snakemake runner, tiny targets
- :mod:`.fault_server` - a fault-injecting OpenAI/OpenRouter-compatible server (``python -m
  eagle3_data.testing.fault_server``)
- :mod:`.rehearsal_server` - the fault server with per-dataset reply profiles (the rehearsal's stand-in)
- :mod:`.rehearsal_data` - the rehearsal's synthetic sources in each dataset's public format
- :mod:`.tokenizer_fixtures` - target tokenizers built locally, the real vocabularies, the public chat templates
  (``chat_templates/``, package data)
- :mod:`.rows` - rows in the generate stage's output shape
- :mod:`.flops` - the FLOP count of a Llama-style decoder (the extraction benchmarks)
- :mod:`.family_rows` - many synthetic conversations per family through tokenize + validate
- :mod:`.headless` - a headless Chromium for the report page
- :mod:`.slurm_cluster` - a real one-node SLURM cluster
- :mod:`.sglang_source` - the pinned sglang wheel's source, read without installing it
"""
