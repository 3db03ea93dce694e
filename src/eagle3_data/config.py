"""The workflow config: validation with defaults and short errors, cross-key checks, and the slices rules get.

``rules/common.smk`` calls :func:`validate_config` (JSON schema ``schemas/config.schema.yaml``; every key with a
``default`` may be left out), :func:`check_layering`, :func:`check_config` and :func:`check_api_keys` before any
job runs; each raises :class:`ConfigError`, whose message is a few lines naming the config file and the key path
(with a "did you mean" for a misspelt key), never a schema dump or a key's value.

Rules pass exactly these slices as ``params:`` — the settings a stage's OUTPUT depends on — so a change
reruns only the rules whose output it changes (e.g. ``merge.max_len`` reruns merge and below, never
generation). Settings that change how a stage runs but not what it writes (concurrency, timeouts, rate
limits, headers, key variable names, launch commands, retries, devices, batch sizes, memory, reject
ceilings) are never params: the stage's script reads them from ``snakemake.config`` at run time, so
changing them reruns nothing. :data:`RERUNS` lists, for every config key, what its change reruns; the
table in docs/config.md is generated from it (``eagle3_data.docgen``) and tests check both against the schema
and dry runs.
"""

from __future__ import annotations

import copy
import difflib
import json
import os
import re
from pathlib import Path
from typing import Iterable, Mapping, Sequence

PRETOKENIZED_FORMATS = {"pretokenized"}

#: At most this many problems are listed in one :class:`ConfigError` (the rest are counted).
MAX_LISTED_PROBLEMS = 8


class ConfigError(ValueError):
    """A problem in the user's config: the message is short, names the file and key path, and says what to do."""


def _dotted(path: Iterable) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def _short(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _secret_path(path: Sequence) -> bool:
    """Keys whose values may be credentials: never echoed in a message."""
    return any(p in ("api_key_env", "headers") for p in path)


def _contains(tree, path: Sequence) -> bool:
    for p in path:
        if isinstance(tree, dict) and p in tree:
            tree = tree[p]
        elif isinstance(tree, list) and isinstance(p, int) and 0 <= p < len(tree):
            tree = tree[p]
        else:
            return False
    return True


def _source_of(path: Sequence, files: Sequence[tuple[str, dict]]) -> str | None:
    """The last of ``files`` (name, parsed YAML) that sets ``path`` (the one whose value the merge kept)."""
    for name, tree in reversed(files):
        if _contains(tree, path):
            return name
    return None


def _key_paths(schema: dict) -> list[tuple[str, dict]]:
    """Every key of the schema as ``(dotted path with <name> for free-form names, resolved node)``."""
    defs = schema.get("$defs", {})
    out: list[tuple[str, dict]] = []

    def walk(node: dict, path: str) -> None:
        node = _resolve(node, defs)
        for name, child in (node.get("properties") or {}).items():
            child = _resolve(child, defs)
            p = f"{path}.{name}" if path else name
            out.append((p, child))
            walk(child, p)
        extra = node.get("additionalProperties")
        if isinstance(extra, dict) and ("properties" in extra or "$ref" in extra):
            p = f"{path}.<name>"
            out.append((p, _resolve(extra, defs)))
            walk(extra, p)

    walk(schema, "")
    return out


def _resolve(node: dict, defs: dict) -> dict:
    """``node`` with its ``$ref`` (``#/$defs/x``) expanded; sibling keywords win, sibling ``properties`` are merged
    key by key (that is how the top-level ``generation`` adds its defaults to the shared definition)."""
    ref = node.get("$ref")
    if not ref:
        return node
    base = defs[ref.split("/")[-1]]
    out = {**base, **{k: v for k, v in node.items() if k not in ("$ref", "properties")}}
    if "properties" in node:
        props = dict(base.get("properties") or {})
        for k, v in node["properties"].items():
            props[k] = {**props.get(k, {}), **v}
        out["properties"] = props
    return out


def _validator(schema: dict):
    """A draft 2020-12 validator that fills in ``default`` values (deep copies) as it validates."""
    from jsonschema import Draft202012Validator, validators

    check_properties = Draft202012Validator.VALIDATORS["properties"]

    def properties_with_defaults(validator, properties, instance, node):
        if isinstance(instance, dict):
            for name, sub in properties.items():
                if isinstance(sub, dict) and "default" in sub and name not in instance:
                    instance[name] = copy.deepcopy(sub["default"])
        yield from check_properties(validator, properties, instance, node)

    return validators.extend(Draft202012Validator, {"properties": properties_with_defaults})(schema)


def _problems(err, all_keys: list[str]) -> list[tuple[list, str, str | None]]:
    """``[(key path, message, suggested key)]`` for one jsonschema error; never echoes a possible secret."""
    path = list(err.absolute_path)
    where = _dotted(path) or "config"
    inst = err.instance
    kind = err.validator
    if kind == "additionalProperties" and isinstance(inst, dict):
        allowed = list((err.schema.get("properties") or {}).keys())
        out = []
        for key in sorted((k for k in inst if k not in allowed), key=str):
            full = _dotted([*path, key])
            close = difflib.get_close_matches(str(key), allowed, n=1, cutoff=0.6)
            if close:
                out.append(([*path, key], f"{full}: unknown key; did you mean {_dotted([*path, close[0]])}?", close[0]))
                continue
            elsewhere = [k.rsplit(".", 1)[0] for k in all_keys if "." in k and k.rsplit(".", 1)[-1] == key]
            if elsewhere:
                out.append(([*path, key], f"{full}: unknown key here; {key} is a key of {', '.join(elsewhere[:3])}", None))
            else:
                out.append(([*path, key], f"{full}: unknown key; valid keys here: {', '.join(allowed)}", None))
        return out
    if kind == "required":
        absent = [k for k in err.validator_value if not (isinstance(inst, dict) and k in inst)]
        where = f"{where}: missing key" if path else "missing top-level key"
        return [(path, f"{where} {', '.join(absent)} (it has no default)", None)]
    if _secret_path(path):
        return [(path, f"{where}: not a valid value here; api_key_env is the NAME of an environment variable "
                       "(letters, digits, _), never the key itself", None)]
    if kind == "enum":
        opts = [str(o) for o in err.validator_value]
        close = difflib.get_close_matches(str(inst), opts, n=1, cutoff=0.6) if isinstance(inst, str) else []
        hint = f"; did you mean {close[0]}?" if close else ""
        return [(path, f"{where}: {_short(inst)} is not one of {', '.join(opts)}{hint}", None)]
    if kind == "type":
        want = err.validator_value
        want = " or ".join(want) if isinstance(want, list) else want
        return [(path, f"{where}: {_short(inst)} is not of type {want!r}", None)]
    msg = err.message if len(err.message) <= 200 else err.message[:197] + "..."
    return [(path, f"{where}: {msg}", None)]


def load_schema(path: str | os.PathLike) -> dict:
    """The config JSON schema (YAML) at ``path`` (libyaml's safe loader where PyYAML has it: the same tree, ~9x
    faster than the pure-Python one, which every job pays once)."""
    import yaml

    return yaml.load(Path(path).read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def validate_config(config: dict, schema: dict, *, files: Sequence[tuple[str, dict]] = ()) -> dict:
    """Check ``config`` against the JSON ``schema`` and fill in every ``default`` (in place; also returned).

    ``files``: the config files the config was merged from, as ``(name, parsed YAML)`` in merge order; each
    problem names the last one that sets the key. Raises :class:`ConfigError` with one line per problem
    (``path: what is wrong``; an unknown key gets the closest valid key at its level, "did you mean", or the
    section it belongs to), at most :data:`MAX_LISTED_PROBLEMS` of them.
    """
    all_keys = [p for p, _ in _key_paths(schema)]
    errors = list(_validator(schema).iter_errors(config))
    if not errors:
        return config
    problems = [p for e in errors for p in _problems(e, all_keys)]
    # "missing key x" next to a misspelt key the message already corrects to x is one problem, not two
    fixed = {(tuple(map(str, path[:-1])), sug) for path, _, sug in problems if sug}
    problems = [p for p in problems
                if not any(tuple(map(str, p[0])) == at and p[1].endswith(f" {sug} (it has no default)")
                           for at, sug in fixed)]
    problems.sort(key=lambda p: tuple(map(str, p[0])))
    sources = [_source_of(path, files) for path, _, _ in problems]
    one_file = len(set(sources)) == 1 and sources[0] is not None
    lines = [text if one_file or src is None else f"{src}: {text}" for (_, text, _), src in zip(problems, sources)]
    head = f"Config error in {sources[0]}:" if one_file else "Config error:"
    if len(lines) == 1:
        raise ConfigError(f"{head} {lines[0]}")
    shown = lines[:MAX_LISTED_PROBLEMS]
    more = f"\n  ... and {len(lines) - len(shown)} more" if len(lines) > len(shown) else ""
    raise ConfigError(head + "".join(f"\n  {line}" for line in shown) + more)


def deep_merge(base: dict, override: dict | None) -> dict:
    """``base`` updated recursively with ``override`` (neither is modified)."""
    out = copy.deepcopy(base)
    for k, v in (override or {}).items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def datasets(config: dict) -> list[str]:
    """All dataset names, in config order."""
    return list(config.get("datasets") or {})


def is_pretokenized(config: dict, ds: str) -> bool:
    """Whether dataset ``ds`` already holds token ids (A-type: it skips generate and tokenize)."""
    return config["datasets"][ds]["source"]["format"] in PRETOKENIZED_FORMATS


def generated_datasets(config: dict) -> list[str]:
    """Datasets whose responses are generated by the target (B-type)."""
    return [d for d in datasets(config) if not is_pretokenized(config, d)]


def pretokenized_datasets(config: dict) -> list[str]:
    """Datasets that arrive pre-tokenized (A-type)."""
    return [d for d in datasets(config) if is_pretokenized(config, d)]


def dataset_shards(config: dict, ds: str) -> int:
    """``datasets.<ds>.shards`` (the schema's default where unset)."""
    from .settings import NormalizeSettings

    return NormalizeSettings.from_config(config, ds).shards


def shard_names(config: dict, ds: str) -> list[str]:
    """Shard file stems of dataset ``ds`` (``000``, ``001``, ...)."""
    from .io import shard_name

    return [shard_name(i) for i in range(dataset_shards(config, ds))]


def generation_config(config: dict, ds: str) -> dict:
    """The generation settings of ``ds``: the global ``generation`` defaults overridden by the dataset's."""
    return deep_merge(config.get("generation") or {}, config["datasets"][ds].get("generation"))


def generation_source(config: dict, ds: str, key: str) -> str | None:
    """Where the generation setting ``key`` of ``ds`` is set: ``"datasets.<ds>.generation.<key>"`` (the dataset's
    own), ``"generation.<key>"`` (the global default), or None where neither sets it (or sets it to null)."""
    own = (config["datasets"][ds].get("generation") or {})
    if own.get(key) is not None:
        return f"datasets.{ds}.generation.{key}"
    if (config.get("generation") or {}).get(key) is not None:
        return f"generation.{key}"
    return None


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
#: extract keys the stored values depend on (the rest: devices, batch size, attention path, locks)
EXTRACT_STATE_KEYS = ("backend", "layers", "dtype", "final_norm", "final_states", "aux_format")

_BELOW_MERGE = "merge; extract where a selection's samples change; export, plan, vocab"
_GEN_CHAIN = ("generate of the datasets using it (only requests the journal lacks are sent), then their tokenize "
              "and validate, report, view, " + _BELOW_MERGE)
_DS_CHAIN = "the dataset's own chain (normalize or generate onward), report, view, " + _BELOW_MERGE
NOTHING = "nothing"

#: For every config key, what changing it reruns (leaves: the key; ``*`` covers every key under a prefix). The
#: table in docs/config.md is rendered from this (eagle3_data.docgen); tests/test_config.py checks every schema
#: key has an entry and tests/test_workflow.py checks the claims with dry runs of the demo build.
RERUNS: list[tuple[str, str]] = [
    ("cache_dir", NOTHING + " (move the directory with it: it holds the journals, the extraction links and what "
                            "the forecast pilot saw)"),
    ("target.name", "generate of every generated dataset (the journal is keyed by the target: new requests), "
                    "tokenize, validate, report, view, " + _BELOW_MERGE),
    ("target.path", "tokenize, validate (the tokenizer), report, view, " + _BELOW_MERGE + " (every selection: another "
                    "checkpoint; rows are reused only if its weights are the same); generate only for "
                    "native_generate backends"),
    ("target.build_tiny", "tiny_target, then as target.path"),
    ("target.trust_remote_code", "tokenize, validate, report, view, " + _BELOW_MERGE),
    ("target.template", "generate of every generated dataset (the request history depends on the family: Kimi "
                        "tool-call ids, reasoning on tool-call turns; the journal answers every request whose prompt "
                        "is unchanged), tokenize, validate, report, view, " + _BELOW_MERGE),
    ("target.chat_template_kwargs", "as target.template"),
    ("target.tiny.*", "tiny_target (the demo's target), then everything that reads it"),
    ("backends.<name>.type", _GEN_CHAIN),
    ("backends.<name>.base_url", "as backends.<name>.type"),
    ("backends.<name>.model", "as backends.<name>.type"),
    ("backends.<name>.extra_body", "as backends.<name>.type"),
    ("backends.<name>.provider", "as backends.<name>.type"),
    ("backends.<name>.reasoning", "as backends.<name>.type"),
    ("backends.<name>.native_generate", "as backends.<name>.type"),
    ("backends.<name>.cost_lookup", "as backends.<name>.type"),
    ("backends.<name>.return_token_ids", "generate of the datasets using it (replies the journal already holds keep "
                                         "what they had: no ids), then their tokenize and validate, report, view, "
                                         + _BELOW_MERGE),
    ("backends.<name>.api_key_env", NOTHING),
    ("backends.<name>.max_concurrency", NOTHING),
    ("backends.<name>.max_jobs", NOTHING),
    ("backends.<name>.timeout_s", NOTHING),
    ("backends.<name>.requests_per_minute", NOTHING),
    ("backends.<name>.tokens_per_minute", NOTHING),
    ("backends.<name>.headers", NOTHING),
    ("backends.<name>.cost_lookup_delay_s", NOTHING),
    ("backends.<name>.down_after_s", NOTHING),
    ("backends.<name>.price_per_m.*", "forecast (its dollars; the pilot is not sent again)"),
    ("backends.<name>.launch.*", NOTHING + " (adding or removing launch: as base_url)"),
    ("generation.backends", "generate of the datasets that don't set their own (only requests the journal lacks "
                            "are sent), then as backends.<name>.type"),
    ("generation.mode", "generate of the datasets that don't set their own (new requests), then " + _DS_CHAIN),
    ("generation.max_tokens", "as generation.mode"),
    ("generation.temperature", "as generation.mode"),
    ("generation.top_p", "as generation.mode"),
    ("generation.extra_body", "as generation.mode"),
    ("generation.max_samples", "generate of the datasets that don't set their own (a larger cap sends only the "
                               "new requests), then " + _DS_CHAIN),
    ("generation.budget_completion_tokens", "as generation.max_samples"),
    ("generation.budget_usd", "as generation.max_samples"),
    ("generation.max_retries", NOTHING + " (`snakemake --forcerun generate` retries failed requests)"),
    ("generation.retry_initial_s", NOTHING),
    ("generation.retry_max_s", NOTHING),
    ("generation.stop_grace_s", NOTHING),
    ("generation.reject_other_models", "as generation.mode"),
    ("datasets.<name>.source.format", _DS_CHAIN),
    ("datasets.<name>.source.path", _DS_CHAIN),
    ("datasets.<name>.source.max_samples", _DS_CHAIN),
    ("datasets.<name>.source.options", _DS_CHAIN),
    ("datasets.<name>.source.max_reject_rate", NOTHING),
    ("datasets.<name>.source.on_error", _DS_CHAIN),
    ("datasets.<name>.shards", _DS_CHAIN + " (every selection of the dataset is new: its states are recomputed)"),
    ("datasets.<name>.generation.max_retries", NOTHING),
    ("datasets.<name>.generation.retry_initial_s", NOTHING),
    ("datasets.<name>.generation.retry_max_s", NOTHING),
    ("datasets.<name>.generation.stop_grace_s", NOTHING),
    ("datasets.<name>.generation.*", "as generation.<key>, for that dataset only"),
    ("normalize.max_reject_rate", NOTHING),
    ("validate.max_reject_rate", NOTHING),
    ("validate.count_tolerance.aggregate_rel", NOTHING),
    ("validate.keep_truncated", "validate of every shard, report, view, " + _BELOW_MERGE),
    ("validate.count_tolerance.per_sample_abs", "as validate.keep_truncated"),
    ("validate.count_tolerance.per_sample_rel", "as validate.keep_truncated"),
    ("validate.max_tokens", "as validate.keep_truncated"),
    ("merge.datasets", _BELOW_MERGE),
    ("merge.max_samples", _BELOW_MERGE + " (a lower cap forwards nothing; a higher one only the samples added)"),
    ("merge.max_len", _BELOW_MERGE + " (a lower cap forwards nothing: a truncation's states are a prefix of the "
                      "stored ones)"),
    ("merge.overflow", _BELOW_MERGE),
    ("merge.seed", "merge, export, plan, vocab (no extraction: the selections are the same)"),
    ("merge.shards", "merge, export, plan, vocab (no extraction)"),
    ("merge.memory_mb", NOTHING),
    ("merge.threads", NOTHING),
    ("extract.backend", "extract (every selection; nothing reusable), export, plan"),
    ("extract.layers", "as extract.backend"),
    ("extract.dtype", "as extract.backend"),
    ("extract.final_norm", "as extract.backend"),
    ("extract.final_states", "as extract.backend"),
    ("extract.aux_format", "as extract.backend"),
    ("extract.gpus_per_job", "plan (wall hours)"),
    ("extract.device", NOTHING + " (plan, when it measures the throughput)"),
    ("extract.batch_tokens", NOTHING + " (plan, when it measures the throughput)"),
    ("extract.attention", NOTHING + " (plan, when it measures the throughput)"),
    ("extract.gpu_lock_dir", NOTHING),
    ("export.layouts", "export of the layouts added"),
    ("export.group_size", "export"),
    ("export.allow_norm_mismatch", NOTHING),
    ("plan.*", "plan"),
    ("forecast.pilot_samples", "forecast_pilot and forecast (a larger pilot sends only the samples the journal "
                               "lacks)"),
    ("vocab.draft_vocab_size", "vocab"),
]


def reruns_of(key: str) -> str | None:
    """What changing config key ``key`` (a schema path such as ``backends.<name>.timeout_s``) reruns, from
    :data:`RERUNS` (exact entries before ``prefix.*`` ones); None when no entry covers it."""
    for k, v in RERUNS:
        if k == key:
            return v
    for k, v in RERUNS:
        if k.endswith(".*") and key.startswith(k[:-1]):
            return v
    return None


def section(config: dict, name: str) -> dict:
    """``config[name]`` with the schema's defaults where unset (a missing or null section gives the defaults); the
    stages read theirs through :mod:`eagle3_data.settings`."""
    from .settings import filled

    return filled(name, config.get(name))


#: source keys the prompts depend on (``max_reject_rate`` only decides whether the job fails)
SOURCE_DATA_KEYS = ("format", "path", "max_samples", "options")


def source_data_settings(config: dict, ds: str) -> dict:
    """The source keys of ``ds`` its normalized rows depend on (:data:`SOURCE_DATA_KEYS`)."""
    from .settings import NormalizeSettings

    return NormalizeSettings.from_config(config, ds).params()


def datasets_data_settings(config: dict) -> dict:
    """Every dataset's source keys (:data:`SOURCE_DATA_KEYS`) and shard count: what the reports depend on."""
    return {ds: {"source": source_data_settings(config, ds), "shards": dataset_shards(config, ds)}
            for ds in datasets(config)}


def generation_data_settings(config: dict, ds: str) -> dict:
    """The generation settings of ``ds`` its responses depend on (:data:`GENERATION_DATA_KEYS`, and
    ``reject_other_models`` when it is set: left at its default it changes nothing, and reruns nothing)."""
    from .settings import GenerateSettings

    return GenerateSettings.from_config(config, ds).params()["generation"]


def backends_data_settings(config: dict, ds: str) -> dict:
    """Per backend ``ds`` uses (priority order): the keys that say which endpoint answers and how requests
    are shaped (:data:`BACKEND_DATA_KEYS`); ``launch`` counts only as present or not."""
    from .settings import GenerateSettings

    return GenerateSettings.from_config(config, ds).params()["backends"]


def target_data_settings(config: dict) -> dict:
    """The target keys prompt rendering and token reconstruction depend on (:data:`TARGET_DATA_KEYS`)."""
    from .settings import TargetSettings

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


def backends_config(config: dict, ds: str) -> dict:
    """The backend definitions the dataset ``ds`` uses, by name, in its priority order.

    Raises ``KeyError`` naming the dataset and the unknown backend.
    """
    names = generation_config(config, ds).get("backends") or []
    out = {}
    for name in names:
        if name not in (config.get("backends") or {}):
            raise KeyError(f"datasets.{ds}.generation.backends: unknown backend {name!r}; defined: {sorted(config.get('backends') or {})}")
        out[name] = config["backends"][name]
    return out


def launch_gpus(config: dict, ds: str) -> int:
    """GPUs of the servers the build launches for dataset ``ds`` (``launch.gpus`` of its backends, summed)."""
    return sum(int((b.get("launch") or {}).get("gpus") or 0) for b in backends_config(config, ds).values())


def backend_job_seats(config: dict, generate_jobs: int) -> dict[str, int]:
    """Generate jobs each backend may have running at once on one machine: ``{backend: seats}``.

    ``generate_jobs`` (G) is the run's cap on generate jobs at once (the ``generate_jobs`` resource,
    profiles/default: 32). Without a cap per backend the scheduler may fill every seat with one backend's
    shards (e.g. 40 shards on a local server) while another backend's requests wait, idle. A job takes a seat
    of each backend its dataset uses. A backend's seats are ``backends.<name>.max_jobs`` or, unset, every seat
    the other backends' own jobs can't use: ``max(e, G - sum over the other backends o of min(n_o, e_o))``,
    with ``e`` the even share ``ceil(G / B)`` over the B backends the generated datasets use, ``e_o`` the even
    share or ``o``'s ``max_jobs`` where set, and ``n_o`` the jobs (shards) that use ``o`` but not this backend.
    So each other backend keeps at least ``min(n_o, e_o)`` seats for its own jobs, and when all the generate
    jobs fit in G every one of them can run at once (an even split would hold back the shards of a dataset that
    uses two backends while one backend's seats are full: in the seed config, 4 of 32 shards started only when
    others ended). Only backends some generated dataset uses are listed.
    """
    jobs = [(set(backends_config(config, ds)), dataset_shards(config, ds))
            for ds in generated_datasets(config)]
    used = sorted({b for names, _n in jobs for b in names})
    g = int(generate_jobs)
    even = -(-g // len(used)) if used else g
    out = {}
    for b in used:
        own = (config["backends"][b] or {}).get("max_jobs")
        if own:
            out[b] = max(1, int(own))
            continue
        reserved = sum(min(int((config["backends"][o] or {}).get("max_jobs") or even),
                           sum(n for names, n in jobs if o in names and b not in names)) for o in used if o != b)
        out[b] = max(1, even, g - reserved)
    return out


def seat_resource(backend: str) -> str:
    """The Snakemake resource name of a backend's generate-job seats: ``generate_jobs_<backend>`` (characters
    other than letters, digits and ``_`` become ``_``)."""
    return "generate_jobs_" + re.sub(r"\W", "_", backend)


#: the completion family of the demo's tiny target (``target.build_tiny``; :mod:`eagle3_data.tiny_target`)
TINY_TARGET_FAMILY = "kimi-k25"


def resolve_target_template(config: dict) -> str | None:
    """Replace ``target.template: auto`` in ``config`` by the family found from the target's own chat template
    (:func:`eagle3_data.templates.auto.resolve_template`, cached under ``cache_dir``: a cache hit imports no
    transformers) and return the line saying which was chosen and why; a named family is kept (an override;
    returns None). A tiny target not built yet (``build_tiny``) takes :data:`TINY_TARGET_FAMILY`. Raises
    :class:`ConfigError` naming the property of the template that failed, or a missing ``target.path``.
    """
    from .templates import TemplateError
    from .templates.auto import describe, resolve_template

    target = config.get("target") or {}
    if (target.get("template") or "auto") == "auto" and target.get("build_tiny") and \
            not Path(str(target.get("path", ""))).exists():
        target["template"] = TINY_TARGET_FAMILY
        return f"target.template: auto -> {TINY_TARGET_FAMILY} (the tiny target, built by rule tiny_target)"
    try:
        family, info = resolve_template(target, config.get("cache_dir"))
    except TemplateError as exc:
        raise ConfigError(f"target.template: {exc}") from None
    target["template"] = family
    return None if info["source"] == "named" else describe(info)


def check_config(config: dict, *, check_paths: bool = True) -> None:
    """Cross-key checks the JSON schema can't express; raises :class:`ConfigError` naming the key.

    Backend names in ``generation.backends`` and every ``datasets.<name>.generation.backends`` must be defined,
    and every generated dataset must have one; dataset names in ``merge.datasets``, ``merge.max_samples`` and
    ``plan.drop`` must exist. With ``check_paths``: every ``datasets.<name>.source.path`` must exist (Snakemake
    would otherwise keep using the outputs of an earlier build when a source path is changed to a missing file),
    and with ``target.build_tiny`` the ``target.path`` must be absent or a tiny target built earlier (the build
    replaces that directory; it must never be a real model's).
    """
    defined = sorted(config.get("backends") or {})
    for name in (config.get("generation") or {}).get("backends") or []:
        if name not in defined:
            raise ConfigError(f"generation.backends: unknown backend {name!r}; defined: {defined}")
    names = datasets(config)
    for ds in names:
        try:
            used = backends_config(config, ds)
        except KeyError as exc:
            raise ConfigError(exc.args[0]) from None
        if not used and not is_pretokenized(config, ds):
            raise ConfigError(f"datasets.{ds}: no backend to generate its responses with; set generation.backends "
                              f"(for every dataset) or datasets.{ds}.generation.backends")
        path = config["datasets"][ds]["source"]["path"]
        if check_paths and not Path(path).exists():
            raise ConfigError(f"datasets.{ds}.source.path: {path} does not exist")
        _check_template_kwargs(config, ds, used)
    try:
        merge_datasets(config)
    except KeyError as exc:
        raise ConfigError(exc.args[0]) from None
    for key, given in (("merge.max_samples", (config.get("merge") or {}).get("max_samples") or {}),
                       ("plan.drop", (config.get("plan") or {}).get("drop") or [])):
        unknown = [d for d in given if d not in names]
        if unknown:
            raise ConfigError(f"{key}: unknown dataset(s) {unknown}; defined: {names}")
    target = config.get("target") or {}
    tpath = Path(str(target.get("path", "")))
    if check_paths and target.get("build_tiny") and tpath.exists() and not (tpath / "tiny_target.json").exists():
        raise ConfigError(f"target.path: {tpath} exists and is not a tiny target this build made, but "
                          "target.build_tiny is true (the build would replace it); set target.build_tiny: false "
                          "for a real model")


def _check_template_kwargs(config: dict, ds: str, used: dict) -> None:
    """Raise :class:`ConfigError` when a backend would render the prompts of ``ds`` with chat-template variables
    other than the ones tokenize renders them with.

    tokenize renders with ``target.chat_template_kwargs`` updated by the dataset's
    ``generation.extra_body.chat_template_kwargs``; a backend's server receives the dataset's
    ``chat_template_kwargs`` when it sets them (the request's ``extra_body`` replaces the backend's), else the
    backend's own ``extra_body.chat_template_kwargs``. A variable the server gets with another value than tokenize
    uses (e.g. ``thinking: false`` on the backend, ``thinking: true`` on the target) would make every prompt's
    ids differ from what the target saw. A variable tokenize uses but the server is not sent is allowed (the
    server's template default, e.g. OpenRouter's, is the user's to know). A ``native_generate`` backend is sent
    the prompt's ids, rendered as tokenize renders them."""
    if is_pretokenized(config, ds):
        return
    target_kw = dict((config.get("target") or {}).get("chat_template_kwargs") or {})
    ds_extra = generation_config(config, ds).get("extra_body") or {}
    rendered = {**target_kw, **(ds_extra.get("chat_template_kwargs") or {})}
    for name, b in used.items():
        if (b or {}).get("native_generate"):  # the prompt ids are rendered here, as tokenize renders them
            continue
        if "chat_template_kwargs" in ds_extra:
            sent, where = ds_extra["chat_template_kwargs"] or {}, f"datasets.{ds}.generation.extra_body"
        else:
            sent, where = ((b or {}).get("extra_body") or {}).get("chat_template_kwargs") or {}, \
                f"backends.{name}.extra_body"
        for k, v in sent.items():
            if rendered.get(k, None) != v:
                have = f"{rendered[k]!r} (target.chat_template_kwargs)" if k in rendered else "not set"
                raise ConfigError(
                    f"{where}.chat_template_kwargs.{k} is {v!r}, but tokenize renders the prompts of {ds} with {k} "
                    f"{have}: the token ids would not be the prompt the target saw. Set target.chat_template_kwargs."
                    f"{k} to {v!r} too (or set it in datasets.{ds}.generation.extra_body.chat_template_kwargs, which "
                    "both use)")


def config_sources(paths: Sequence[str | os.PathLike], default: str | os.PathLike | None = None) -> list[tuple[str, dict]]:
    """The config files a run merges, as ``(path, parsed YAML)`` in merge order (paths under the working directory
    shown relative to it).

    ``paths``: the ``--configfile`` arguments (Snakemake's ``workflow.overwrite_configfiles``); none given: the
    embedded ``default``. A file that can't be read or parsed is left out (Snakemake reports it itself).
    """
    import yaml

    names = [str(p) for p in paths] or ([str(default)] if default is not None else [])
    out = []
    for name in names:
        try:
            tree = yaml.safe_load(Path(name).read_text())
        except (OSError, yaml.YAMLError):
            continue
        shown = os.path.relpath(name) if os.path.isabs(name) else name
        out.append((name if shown.startswith("..") else shown, tree if isinstance(tree, dict) else {}))
    return out


def check_layering(files: Sequence[tuple[str, dict]]) -> None:
    """Refuse a merge of several config files that would build datasets the user did not mean to.

    Snakemake merges ``--configfile a.yaml b.yaml`` key by key, so the datasets of ``a.yaml`` are kept next to
    ``b.yaml``'s and get ``b.yaml``'s target and backends (e.g. the demo's datasets sent to a paid endpoint).
    Rule: a file that is a config of its own (it sets ``target`` or ``backends``, and defines datasets of its
    own: entries with a ``source``) must name every dataset defined by the files before it; naming one
    (``name: {}`` keeps it as it is) is how to keep it. Files that only add datasets or change keys
    (``merge.max_len: 512``, ``datasets.x.shards: 4``) layer as usual.
    Raises :class:`ConfigError` naming both files and the datasets.
    """
    defined_by: dict[str, str] = {}
    for name, tree in files:
        entries = tree.get("datasets") if isinstance(tree.get("datasets"), dict) else {}
        own = [ds for ds, e in entries.items() if isinstance(e, dict) and "source" in e and ds not in defined_by]
        earlier = [ds for ds in defined_by if ds not in entries]
        if own and earlier and ({"target", "backends"} & set(tree)):
            origins = sorted({defined_by[ds] for ds in earlier})
            raise ConfigError(
                f"Config error: {name} is a config of its own (target or backends, and datasets), so the datasets "
                f"of {', '.join(origins)} ({', '.join(earlier)}) would be built too, with its target and backends "
                f"(--configfile files are merged key by key). Use {name} alone (keys it leaves out take their "
                f"defaults), or name in it each dataset to keep (e.g. `{earlier[0]}: {{}}`)."
            )
        for ds in own:
            defined_by[ds] = name


def pending_generation(config: dict, root: str | os.PathLike = ".") -> list[str]:
    """Generated datasets with a responses shard not written yet under ``root/results/`` (those that will send
    requests; a dataset whose responses all exist needs no API key for a rerun of later stages)."""
    root = Path(root)
    return [ds for ds in generated_datasets(config)
            if not all((root / f"results/{ds}/responses/{s}.parquet").exists() for s in shard_names(config, ds))]


def check_api_keys(config: dict, dataset_names: Iterable[str], environ: Mapping[str, str] | None = None) -> None:
    """Every ``api_key_env`` of the backends that ``dataset_names`` generate with must be set (non-empty).

    Raises :class:`ConfigError` naming each missing variable, the backend and datasets using it, and any set
    variable with a close name (a typo or another spelling). Never reads out a value.
    """
    env = os.environ if environ is None else environ
    users: dict[str, list[str]] = {}
    for ds in dataset_names:
        for name in backends_config(config, ds):
            users.setdefault(name, []).append(ds)
    lines = []
    for name, dss in users.items():
        var = (config["backends"][name] or {}).get("api_key_env")
        if not var or env.get(var):
            continue
        close = _close_names(var, [k for k, v in env.items() if v])
        also = f"; set, with a close name: {', '.join(close)}" if close else ""
        lines.append(f"{var} is not set (backends.{name}.api_key_env, used by {', '.join(dss)}){also}")
    if not lines:
        return
    todo = "export the key under the name the config gives (or correct api_key_env), then run again"
    if len(lines) == 1:
        raise ConfigError(f"Config error: {lines[0]}. {todo[0].upper() + todo[1:]}.")
    raise ConfigError("Config error:" + "".join(f"\n  {line}" for line in lines) + f"\n  {todo[0].upper() + todo[1:]}.")


def _close_names(name: str, candidates: Sequence[str]) -> list[str]:
    """Environment variable names close to ``name``: other case, a close spelling, or sharing a word (3+ letters)
    such as ``OPENROUTER`` in ``OPENROUTER_KEY``; at most three."""
    upper = {c.upper(): c for c in candidates}
    found = [upper[k] for k in difflib.get_close_matches(name.upper(), list(upper), n=3, cutoff=0.75)]
    words = {w for w in name.upper().split("_") if len(w) >= 3 and w not in ("API", "KEY", "TOKEN", "SECRET")}
    for c in sorted(candidates):
        if c not in found and words & set(c.upper().split("_")) and any(w in c.upper() for w in ("KEY", "TOKEN")):
            found.append(c)
    return [c for c in found if c != name][:3]


def merged_shard_names(config: dict) -> list[str]:
    """Stems of the merged shards (``merge.shards`` of them)."""
    from .io import shard_name

    return [shard_name(i) for i in range(int(config["merge"]["shards"]))]


def merge_datasets(config: dict) -> list[str]:
    """Datasets included in the merge (``merge.datasets``, default all), checked against ``datasets``."""
    chosen = config["merge"].get("datasets")
    if chosen is None:
        return datasets(config)
    unknown = [d for d in chosen if d not in config["datasets"]]
    if unknown:
        raise KeyError(f"merge.datasets: unknown dataset(s) {unknown}; defined: {datasets(config)}")
    return list(chosen)
