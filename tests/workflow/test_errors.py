"""A bad config value and a malformed input row each give a clear, specific error."""

from __future__ import annotations

import json
import os

import yaml

from eagle3_data.testing.workflow import copy_workflow, run_snakemake


def _write_config(wd, mutate):
    cfg = yaml.safe_load((wd / "config.yaml").read_text())
    mutate(cfg)
    (wd / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))


def _lines(out: str) -> list[str]:
    """Output lines other than Snakemake's own profile notice."""
    return [ln for ln in out.splitlines() if ln.strip() and not ln.startswith("Using workflow specific profile")]


def test_bad_config_value_names_the_key(tmp_path):
    wd = copy_workflow(tmp_path)
    _write_config(wd, lambda c: c["merge"].__setitem__("max_len", "long"))
    proc = run_snakemake(wd, "-n", check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert _lines(out) == ["Config error in config.yaml: merge.max_len: 'long' is not of type 'integer'"], out


def test_config_typo_is_one_line_with_did_you_mean(tmp_path):
    """A typo in a config of one's own: one line naming the file and key, the closest valid key, no schema dump."""
    wd = copy_workflow(tmp_path)
    mine = yaml.safe_load((wd / "resources/configs/sglang-local.yaml").read_text())
    mine["generation"]["max_token"] = mine["generation"].pop("max_tokens")
    (wd / "my.yaml").write_text(yaml.safe_dump(mine, sort_keys=False))
    proc = run_snakemake(wd, "-n", "--configfile", "my.yaml", check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1
    assert _lines(out) == [
        "Config error in my.yaml: generation.max_token: unknown key; did you mean generation.max_tokens?"
    ], out
    assert "Traceback" not in out and "additionalProperties" not in out


def test_unknown_config_key_is_rejected(tmp_path):
    wd = copy_workflow(tmp_path)
    _write_config(wd, lambda c: c["merge"].__setitem__("max_lenght", 10))
    proc = run_snakemake(wd, "-n", check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "merge.max_lenght: unknown key; did you mean merge.max_len?" in out


def test_missing_key_variable_stops_before_any_job_and_a_dry_run_only_warns(tmp_path, demo_run):
    wd = copy_workflow(tmp_path)
    # the config's target (checked before any job): the demo's tiny Kimi K2.5-style target, as in the README route
    (wd / "models").mkdir()
    (wd / "models" / "Kimi-K2.5").symlink_to(demo_run / "results" / "target" / "tiny-kimi")
    # the README route's step 2: a copy of the OpenRouter config with a draft vocabulary that fits the tiny target
    (wd / "my.yaml").write_text(
        (wd / "resources/configs/openrouter.yaml").read_text() + "\nvocab:\n  draft_vocab_size: 256\n"
    )
    env = {"OPENROUTER_KEY": "sk-or-v1-NOT-TO-BE-PRINTED"}
    cmd = ["--configfile", "my.yaml"]
    proc = run_snakemake(wd, "--cores", "1", *cmd, check=False, env=env, unset=["OPENROUTER_API_KEY"])
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1
    assert _lines(out) == [
        "Config error: OPENROUTER_API_KEY is not set (backends.openrouter.api_key_env, used by sharegpt); set, with "
        "a close name: OPENROUTER_KEY. Export the key under the name the config gives (or correct api_key_env), "
        "then run again."
    ], out
    assert "NOT-TO-BE-PRINTED" not in out
    assert not (wd / "results").exists() and not (wd / "logs").exists(), "no job ran"
    dry = run_snakemake(wd, "-n", *cmd, check=False, unset=["OPENROUTER_API_KEY"])
    assert dry.returncode == 0, dry.stdout[-3000:] + dry.stderr[-3000:]
    assert "Warning (dry run): Config error: OPENROUTER_API_KEY is not set" in dry.stdout + dry.stderr


def test_layering_a_config_of_ones_own_on_the_demo_is_refused(tmp_path):
    wd = copy_workflow(tmp_path)
    proc = run_snakemake(wd, "-n", "--configfile", "config.yaml", "resources/configs/openrouter.yaml", check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1
    (line,) = _lines(out)
    assert line.startswith(
        "Config error: resources/configs/openrouter.yaml is a config of its own (target or "
        "backends, and datasets), so the datasets of config.yaml (sharegpt_demo, ultrachat_demo, "
        "sweagent_demo, pretokenized_demo) would be built too, with its target and backends"
    )


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
    assert "ultrachat.jsonl:5: invalid JSON" in log, log[-2000:]  # file:line
    assert not (wd / "results/ultrachat_demo/prompts/000.parquet").exists()
    assert "normalize_ultrachat_demo" in out
    # an expected failure (errors.run_stage): one ERROR line naming the file and line, no traceback anywhere
    errors = [ln for ln in log.splitlines() if " ERROR " in ln]
    assert len(errors) == 1 and "ultrachat.jsonl:5:" in errors[0], log[-2000:]
    assert "Traceback" not in log and "Traceback" not in out, out[-3000:]


def test_missing_source_file_names_the_key(tmp_path):
    """Also after a build: Snakemake alone would keep using the old outputs of a source that went missing."""
    wd = copy_workflow(tmp_path)
    _write_config(
        wd, lambda c: c["datasets"]["ultrachat_demo"]["source"].__setitem__("path", "resources/samples/nope.jsonl")
    )
    proc = run_snakemake(wd, "-n", check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "datasets.ultrachat_demo.source.path: resources/samples/nope.jsonl does not exist" in out


def test_a_dataset_built_for_another_target_is_refused_before_any_job(tmp_path, demo_run):
    """Two shipped configs name a dataset `sharegpt` for two targets: the second in the same results/ tree is
    refused in one line (a dry run too), before its files and the other build's could mix; the demo's run recorded
    its own."""
    assert json.loads((demo_run / "results/sharegpt_demo/.built-by.json").read_text()) == {
        "config": "config.yaml",
        "dataset": "sharegpt_demo",
        "target": "results/target/tiny-kimi",
    }
    wd = copy_workflow(tmp_path)
    (wd / "results/sharegpt").mkdir(parents=True)
    (wd / "results/sharegpt/.built-by.json").write_text(
        json.dumps({"config": "resources/configs/openrouter.yaml", "dataset": "sharegpt", "target": "models/Kimi-K2.5"})
    )
    proc = run_snakemake(wd, "-n", "--configfile", "resources/configs/real-small.yaml", check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1
    assert _lines(out) == [
        "Config error: results/sharegpt/ holds dataset sharegpt built for target models/Kimi-K2.5 (by "
        "resources/configs/openrouter.yaml); resources/configs/real-small.yaml builds it for "
        "results/target/smollm2-135m-instruct: their files would mix. Keep that build by moving it aside first (mv "
        "results results.openrouter; mv logs logs.openrouter), or, to rebuild it here for "
        "results/target/smollm2-135m-instruct, delete results/sharegpt/.built-by.json"
    ], out
    os.rename(wd / "results", wd / "results.openrouter")  # what the line says: then the dry run plans the build
    proc = run_snakemake(wd, "-n", "--configfile", "resources/configs/real-small.yaml", check=False)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
