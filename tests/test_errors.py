"""A bad config value and a malformed input row each give a clear, specific error."""

from __future__ import annotations

import yaml

from conftest import copy_workflow, run_snakemake


def _write_config(wd, mutate):
    cfg = yaml.safe_load((wd / "config.yaml").read_text())
    mutate(cfg)
    (wd / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))


def test_bad_config_value_names_the_key(tmp_path):
    wd = copy_workflow(tmp_path)
    _write_config(wd, lambda c: c["merge"].__setitem__("max_len", "long"))
    proc = run_snakemake(wd, "-n", check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "'long' is not of type 'integer'" in out
    assert "['merge']['max_len']" in out


def test_unknown_config_key_is_rejected(tmp_path):
    wd = copy_workflow(tmp_path)
    _write_config(wd, lambda c: c["merge"].__setitem__("max_lenght", 10))
    proc = run_snakemake(wd, "-n", check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "max_lenght" in out and "Additional properties are not allowed" in out


def test_unknown_backend_names_the_dataset(tmp_path):
    wd = copy_workflow(tmp_path)
    _write_config(wd, lambda c: c["datasets"]["ultrachat_demo"].__setitem__("generation", {"backends": ["nope"]}))
    proc = run_snakemake(wd, "-n", check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "datasets.ultrachat_demo.generation.backends: unknown backend 'nope'" in out


def test_malformed_input_row_names_file_and_line(tmp_path):
    wd = copy_workflow(tmp_path)
    src = wd / "resources/samples/ultrachat.jsonl"
    lines = src.read_text().splitlines()
    lines[4] = lines[4][: len(lines[4]) // 2]  # a torn JSON record on line 5
    src.write_text("\n".join(lines) + "\n")
    proc = run_snakemake(wd, "--cores", "1", "results/ultrachat_demo/rejected/normalize.parquet", check=False)
    out = proc.stdout + proc.stderr
    log = (wd / "logs/normalize/ultrachat_demo.log").read_text()
    assert proc.returncode != 0
    assert "ultrachat.jsonl" in log and "line 5" in log, log[-2000:]
    assert not (wd / "results/ultrachat_demo/prompts/000.parquet").exists()
    assert "normalize_ultrachat_demo" in out


def test_missing_source_file_names_the_key(tmp_path):
    """Also after a build: Snakemake alone would keep using the old outputs of a source that went missing."""
    wd = copy_workflow(tmp_path)
    _write_config(wd, lambda c: c["datasets"]["ultrachat_demo"]["source"].__setitem__("path", "resources/samples/nope.jsonl"))
    proc = run_snakemake(wd, "-n", check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "datasets.ultrachat_demo.source.path: resources/samples/nope.jsonl does not exist" in out
