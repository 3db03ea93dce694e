"""The workflow config: validation with defaults and short errors, cross-key checks, and the slices rules get.

``rules/common.smk`` calls :func:`validate_config` (JSON schema ``schemas/config.schema.yaml``; every key with a
``default`` may be left out), :func:`check_layering`, :func:`check_config` and :func:`check_api_keys` before any
job runs; each raises :class:`ConfigError`, whose message is a few lines naming the config file and the key path
(with a "did you mean" for a misspelt key), never a schema dump or a key's value.

Rules pass exactly the slices below as ``params:``, so a change reruns only the rules that depend on it
(e.g. ``merge.max_len`` reruns merge and below, never generation).
"""

from __future__ import annotations

import copy
import difflib
import json
import os
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
    """The config JSON schema (YAML) at ``path``."""
    import yaml

    return yaml.safe_load(Path(path).read_text())


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


def shard_names(config: dict, ds: str) -> list[str]:
    """Shard file stems of dataset ``ds`` (``000``, ``001``, ...)."""
    from .io import shard_name

    return [shard_name(i) for i in range(int(config["datasets"][ds].get("shards", 1)))]


def generation_config(config: dict, ds: str) -> dict:
    """The generation settings of ``ds``: the global ``generation`` defaults overridden by the dataset's."""
    return deep_merge(config.get("generation") or {}, config["datasets"][ds].get("generation"))


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
    ``b.yaml``'s and get ``b.yaml``'s backends and generation settings (e.g. the demo's datasets sent to a paid
    endpoint). Rule: a file that defines datasets of its own (an entry with a ``source``) must name every
    dataset defined by the files before it; naming one (``name: {}`` keeps it as it is) is how to keep it.
    Files that only change keys of datasets defined earlier (``datasets.x.shards: 4``) are always fine.
    Raises :class:`ConfigError` naming both files and the datasets.
    """
    defined_by: dict[str, str] = {}
    for name, tree in files:
        entries = tree.get("datasets") if isinstance(tree.get("datasets"), dict) else {}
        own = [ds for ds, e in entries.items() if isinstance(e, dict) and "source" in e and ds not in defined_by]
        earlier = [ds for ds in defined_by if ds not in entries]
        if own and earlier:
            origins = sorted({defined_by[ds] for ds in earlier})
            raise ConfigError(
                f"Config error: {name} brings its own datasets ({', '.join(own)}), so the datasets of "
                f"{', '.join(origins)} ({', '.join(earlier)}) would be built too, with {name}'s settings "
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


def schema_reference(schema: dict) -> str:
    """A markdown table of every config key in the JSON ``schema`` (path, type, allowed values, description).

    The README's config reference is this function's output; a test keeps the two equal.
    """
    def kind(node: dict) -> str:
        t = node.get("type", "object" if "properties" in node else "")
        t = " or ".join(t) if isinstance(t, list) else t
        if node.get("type") == "array" or (isinstance(node.get("type"), list) and "array" in node["type"]):
            item = node.get("items", {}).get("type")
            if item:
                t = t.replace("array", f"list of {item}")
        return t

    def note(node: dict) -> str:
        parts = []
        if "enum" in node:
            parts.append("one of " + ", ".join(f"`{v}`" for v in node["enum"]))
        for key, word in (("minimum", ">="), ("exclusiveMinimum", ">"), ("maximum", "<=")):
            if key in node:
                parts.append(f"{word} {node[key]}")
        if "default" in node:
            parts.append(f"default `{json.dumps(node['default'])}`")
        if node.get("description"):
            parts.append(node["description"])
        return "; ".join(parts)

    rows = []
    for p, node in _key_paths(schema):
        if p.endswith(".<name>"):
            rows.append((p, "object", "one entry per name"))
        else:
            rows.append((p, kind(node), note(node)))
    lines = ["| key | type | values / meaning |", "|---|---|---|"]
    lines += [f"| `{p}` | {t} | {n.replace('|', '/')} |" for p, t, n in rows]
    return "\n".join(lines) + "\n"


README_START = "<!-- config-reference:start -->"
README_END = "<!-- config-reference:end -->"


def readme_with_reference(readme: str, schema: dict) -> str:
    """``readme`` with the text between the config-reference markers replaced by :func:`schema_reference`.

    Raises ``ValueError`` if the markers are missing.
    """
    if README_START not in readme or README_END not in readme:
        raise ValueError(f"README has no {README_START} ... {README_END} section")
    head, rest = readme.split(README_START, 1)
    _, tail = rest.split(README_END, 1)
    return f"{head}{README_START}\n{schema_reference(schema)}{README_END}{tail}"


def main(argv: list[str] | None = None) -> None:
    """``python -m eagle3_data.config README.md [schema]``: rewrite the README's config reference."""
    import sys
    from pathlib import Path

    import yaml

    args = sys.argv[1:] if argv is None else argv
    readme = Path(args[0] if args else "README.md")
    schema = Path(args[1]) if len(args) > 1 else readme.parent / "schemas" / "config.schema.yaml"
    readme.write_text(readme_with_reference(readme.read_text(), yaml.safe_load(schema.read_text())))


if __name__ == "__main__":
    main()
