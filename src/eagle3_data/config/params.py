"""The config slices rules pass as ``params:``: the settings a stage's output depends on, and nothing else."""

from __future__ import annotations

from pathlib import Path


#: generation keys that shape the requests and which samples are sent (the rest: retries, transport)
GENERATION_DATA_KEYS = (
    "backends",
    "mode",
    "max_tokens",
    "temperature",
    "top_p",
    "extra_body",
    "max_samples",
    "budget_completion_tokens",
    "budget_usd",
)
#: backend keys that say which endpoint answers and how a request body is shaped (the rest: transport)
BACKEND_DATA_KEYS = (
    "type",
    "base_url",
    "model",
    "extra_body",
    "provider",
    "reasoning",
    "native_generate",
    "cost_lookup",
)
#: target keys the prompt rendering and reconstruction depend on (``tiny`` is rule tiny_target's)
TARGET_DATA_KEYS = ("name", "path", "trust_remote_code", "template", "chat_template_kwargs", "build_tiny")
#: validate keys that decide which rows are rejected (``max_reject_rate`` and ``aggregate_rel`` only decide
#: whether the job fails)
VALIDATE_DATA_KEYS = ("keep_truncated", "max_tokens")
#: merge keys that decide the merged rows (``memory_mb``, ``threads``: resources)
MERGE_DATA_KEYS = ("datasets", "max_samples", "max_len", "overflow", "seed", "shards")
#: extract keys the stored values depend on (the rest: devices, batch size, attention path, locks);
#: ``ExtractSettings.params`` leaves the last three out where they are at their defaults
EXTRACT_STATE_KEYS = (
    "backend",
    "layers",
    "dtype",
    "final_norm",
    "final_states",
    "aux_format",
    "final_format",
    "drafters",
    "dflash_layers",
)


def section(config: dict, name: str) -> dict:
    """``config[name]`` with the schema's defaults where unset (a missing or null section gives the defaults); the
    stages read theirs through :mod:`eagle3_data.settings`."""
    from .schema import filled

    return filled(name, config.get(name))


#: source keys the prompts depend on (``max_reject_rate`` only decides whether the job fails)
SOURCE_DATA_KEYS = ("format", "path", "max_samples", "options")


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
