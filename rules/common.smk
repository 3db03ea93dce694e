# Config validation, dataset lists, input functions and wildcard constraints shared by every stage.

import re
import sys
from pathlib import Path

from snakemake.utils import validate

validate(config, schema="../schemas/config.schema.yaml")

from eagle3_data import config as cfg

cfg.check_config(config)  # unknown backend/dataset names, missing source files: fail early, naming the key

DATASETS = cfg.datasets(config)
GENERATED = cfg.generated_datasets(config)
PRETOKENIZED = cfg.pretokenized_datasets(config)
MERGE_DATASETS = cfg.merge_datasets(config)
MERGED_SHARDS = cfg.merged_shard_names(config)
EXPORT_LAYOUTS = (config.get("export") or {}).get("layouts", [])  # no export section: no export
TARGET = config["target"]
CACHE_DIR = config["cache_dir"]


def _alternation(names):
    return "|".join(re.escape(n) for n in names) if names else "(?!x)x"


wildcard_constraints:
    ds=_alternation(DATASETS),
    shard=r"\d{3}",
    k=r"\d{3}",


def shards(ds):
    return cfg.shard_names(config, ds)


def target_input():
    """The target directory, when the build makes it (tiny target), so a rebuild reruns what uses it."""
    return [TARGET["path"]] if TARGET.get("build_tiny") else []


def validated_files(datasets):
    return [f"results/{ds}/validated/{s}.parquet" for ds in datasets for s in shards(ds)]


def rejected_files(datasets):
    out = [f"results/{ds}/rejected/normalize.parquet" for ds in datasets]
    return out + [f"results/{ds}/rejected/{s}.parquet" for ds in datasets for s in shards(ds)]


def selection_path(ds, shard):
    return f"results/merged/selection/{ds}/{shard}.parquet"


def selection_files(datasets):
    """Merge selections, one per validated shard, in validated_files() order."""
    return [selection_path(ds, s) for ds in datasets for s in shards(ds)]


def states_files(datasets):
    return [f"results/hidden_states/{ds}/{s}.safetensors" for ds in datasets for s in shards(ds)]


def extract_input(wildcards):
    """The selection to forward, once the merge checkpoint has run. ancient(): a merge that rewrites the file
    with the same rows must not rerun the job; a changed selection does, through its digest in params."""
    checkpoints.merge.get()
    return {"selection": ancient(selection_path(wildcards.ds, wildcards.shard)), "target": target_input()}


def selection_digest(wildcards):
    """The merge's digest of this selection (manifest.json), so a changed selection reruns its extract job."""
    manifest = checkpoints.merge.get().output.manifest
    return cfg.selection_digest(manifest, f"{wildcards.ds}/{wildcards.shard}")


def responses_files(datasets):
    return [f"results/{ds}/responses/{s}.parquet" for ds in datasets if ds in GENERATED for s in shards(ds)]


def print_tally(path):
    p = Path(path)
    if p.exists():
        print("\n" + p.read_text(), file=sys.stderr)
