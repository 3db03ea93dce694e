"""The config slices rules pass as ``params:``: the settings a stage's output depends on, and nothing else."""

from __future__ import annotations

from pathlib import Path

from .lookup import dataset_shards, datasets, is_original


#: generation keys that shape the requests and which samples are sent (the rest: retries, transport)
GENERATION_DATA_KEYS = ("backends", "mode", "max_tokens", "temperature", "top_p", "extra_body", "max_samples",
                        "budget_completion_tokens", "budget_usd")
#: backend keys that say which endpoint answers and how a request body is shaped (the rest: transport)
BACKEND_DATA_KEYS = ("type", "base_url", "model", "extra_body", "provider", "reasoning", "native_generate",
                     "cost_lookup")
#: target keys the prompt rendering and reconstruction depend on (``tiny`` is rule tiny_target's)
TARGET_DATA_KEYS = ("name", "path", "trust_remote_code", "template", "chat_template_kwargs", "build_tiny")
#: validate keys that decide which rows are rejected (``max_reject_rate`` and ``aggregate_rel`` only decide
#: whether the job fails)
VALIDATE_DATA_KEYS = ("keep_truncated", "max_tokens")
#: merge keys that decide the merged rows (``memory_mb``, ``threads``: resources)
MERGE_DATA_KEYS = ("datasets", "max_samples", "max_len", "overflow", "seed", "shards")
#: extract keys the stored values depend on (the rest: devices, batch size, attention path, locks);
#: ``ExtractSettings.params`` leaves the last three out where they are at their defaults
EXTRACT_STATE_KEYS = ("backend", "layers", "dtype", "final_norm", "final_states", "aux_format", "final_format",
                      "drafters", "dflash_layers")


def section(config: dict, name: str) -> dict:
    """``config[name]`` with the schema's defaults where unset (a missing or null section gives the defaults); the
    stages read theirs through :mod:`eagle3_data.settings`."""
    from ..settings import filled

    return filled(name, config.get(name))


#: source keys the prompts depend on (``max_reject_rate`` only decides whether the job fails)
SOURCE_DATA_KEYS = ("format", "path", "max_samples", "options")


def source_data_settings(config: dict, ds: str) -> dict:
    """The source keys of ``ds`` its normalized rows depend on (:data:`SOURCE_DATA_KEYS`)."""
    from ..settings import NormalizeSettings

    return NormalizeSettings.from_config(config, ds).params()


def datasets_data_settings(config: dict) -> dict:
    """Every dataset's source keys (:data:`SOURCE_DATA_KEYS`) and shard count: what the reports depend on; and
    ``answers: original`` where set (only then, so the other datasets' slices stay as they were)."""
    out = {}
    for ds in datasets(config):
        out[ds] = {"source": source_data_settings(config, ds), "shards": dataset_shards(config, ds)}
        if is_original(config, ds):
            out[ds]["answers"] = "original"
    return out


def generation_data_settings(config: dict, ds: str) -> dict:
    """The generation settings of ``ds`` its responses depend on (:data:`GENERATION_DATA_KEYS`, and
    ``reject_other_models`` when it is set: left at its default it changes nothing, and reruns nothing)."""
    from ..settings import GenerateSettings

    return GenerateSettings.from_config(config, ds).params()["generation"]


def backends_data_settings(config: dict, ds: str) -> dict:
    """Per backend ``ds`` uses (priority order): the keys that say which endpoint answers and how requests
    are shaped (:data:`BACKEND_DATA_KEYS`); ``launch`` counts only as present or not."""
    from ..settings import GenerateSettings

    return GenerateSettings.from_config(config, ds).params()["backends"]


def target_data_settings(config: dict) -> dict:
    """The target keys prompt rendering and token reconstruction depend on (:data:`TARGET_DATA_KEYS`)."""
    from ..settings import TargetSettings

    return TargetSettings.from_config(config).params()


_MANIFESTS: dict = {}


def selection_digest(manifest_path, key: str) -> str:
    """The digest of selection ``key`` (``"<dataset>/<shard>"``) in the merge manifest (read once per change of
    the file). Raises KeyError naming the key and the manifest when the merge did not write that selection."""
    p = Path(manifest_path)
    st = p.stat()
    cached = _MANIFESTS.get(str(p))
    if cached is None or cached[0] != (st.st_mtime_ns, st.st_size):
        import json

        cached = ((st.st_mtime_ns, st.st_size), json.loads(p.read_text()).get("selections") or {})
        _MANIFESTS[str(p)] = cached
    try:
        return cached[1][key]["digest"]
    except KeyError:
        raise KeyError(f"{manifest_path}: no selection {key!r} (rerun the merge)") from None
