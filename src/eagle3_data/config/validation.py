"""Validation of the config against the JSON schema: defaults filled in, and short errors naming the file and the key
path (with a "did you mean" for a misspelt key), never a schema dump or a key's value."""

from __future__ import annotations

import copy
import difflib
import os
from pathlib import Path
from typing import Iterable, Sequence


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


def yaml_keys(text: str) -> tuple[dict[tuple, int], list[tuple[tuple, int, int]]]:
    """The mapping keys of a YAML document: ``(lines, duplicates)``, ``lines`` mapping each key's path (a tuple
    of keys) to its 1-based line (the last one, where a key repeats: the value YAML keeps), ``duplicates`` every
    key set twice in one mapping as ``(path, first line, second line)``. Raises ``yaml.YAMLError``."""
    import yaml

    root = yaml.compose(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    lines: dict[tuple, int] = {}
    dups: list[tuple[tuple, int, int]] = []

    def walk(node, path: tuple) -> None:
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for k, v in node.value:
                if not isinstance(k, yaml.ScalarNode) or k.tag == "tag:yaml.org,2002:merge":
                    continue
                key = _scalar_key(k)
                line = k.start_mark.line + 1
                if key in seen:
                    dups.append((path + (key,), seen[key], line))
                seen[key] = line
                lines[path + (key,)] = line
                walk(v, path + (key,))
        elif isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                walk(v, path + (i,))

    walk(root, ())
    return lines, sorted(dups, key=lambda d: (d[2], d[1]))


def _scalar_key(node):
    """A scalar key node's value as the safe loader builds it (``1`` an int, ``true`` a bool, else text)."""
    import yaml

    try:
        return yaml.SafeLoader("").construct_object(node)
    except yaml.YAMLError:
        return node.value


def key_line(file: str | os.PathLike, path: Sequence) -> int | None:
    """The line of key ``path`` in YAML ``file`` (None when it is not there or the file can't be read)."""
    import yaml

    try:
        return yaml_keys(Path(file).read_text())[0].get(tuple(path))
    except (OSError, ValueError, yaml.YAMLError):
        return None


def key_paths(schema: dict) -> list[tuple[str, dict]]:
    """Every key of the schema as ``(dotted path with <name> for free-form names, resolved node)``."""
    defs = schema.get("$defs", {})
    out: list[tuple[str, dict]] = []

    def walk(node: dict, path: str) -> None:
        node = resolve_ref(node, defs)
        for name, child in (node.get("properties") or {}).items():
            child = resolve_ref(child, defs)
            p = f"{path}.{name}" if path else name
            out.append((p, child))
            walk(child, p)
        extra = node.get("additionalProperties")
        if isinstance(extra, dict) and ("properties" in extra or "$ref" in extra):
            p = f"{path}.<name>"
            out.append((p, resolve_ref(extra, defs)))
            walk(extra, p)

    walk(schema, "")
    return out


def resolve_ref(node: dict, defs: dict) -> dict:
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
                out.append(
                    ([*path, key], f"{full}: unknown key here; {key} is a key of {', '.join(elsewhere[:3])}", None)
                )
            else:
                out.append(([*path, key], f"{full}: unknown key; valid keys here: {', '.join(allowed)}", None))
        return out
    if kind == "required":
        absent = [k for k in err.validator_value if not (isinstance(inst, dict) and k in inst)]
        many = len(absent) > 1
        where = f"{where}: missing key{'s' * many}" if path else f"missing top-level key{'s' * many}"
        text = f"{where} {', '.join(absent)} ({'they have' if many else 'it has'} no default)"
        if not path and {"target", "datasets"} <= set(absent):
            text += (
                "; a file that only adds keys is layered over a whole config, named first: "
                "--configfile config.yaml <this file>"
            )
        return [(path, text, None)]
    if _secret_path(path):
        return [
            (
                path,
                f"{where}: not a valid value here; api_key_env is the NAME of an environment variable "
                "(letters, digits, _), never the key itself",
                None,
            )
        ]
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


def _where(path: Sequence, files: Sequence[tuple[str, dict]]) -> str:
    """``"my.yaml line 12: "``: the file (and line) that sets ``path``, or ``""`` when no file does."""
    src = _source_of(path, files)
    if src is None:
        return ""
    line = key_line(src, path)
    return f"{src} line {line}: " if line else f"{src}: "


def check_bounds(config: dict, files: Sequence[tuple[str, dict]] = ()) -> None:
    """Numbers that cost money or time within ``bounds`` (defaults filled in): every backend's
    ``max_concurrency`` at most ``bounds.max_concurrency``, every dataset's ``shards`` at most
    ``bounds.max_shards``. Raises :class:`ConfigError` naming the file, line and key, and the bound to raise."""
    bounds = config.get("bounds") or {}
    checks = [
        (
            ("backends", name, "max_concurrency"),
            (b or {}).get("max_concurrency"),
            "max_concurrency",
            "requests in flight to the backend (a budget stop lets them finish: they bound its overshoot)",
        )
        for name, b in (config.get("backends") or {}).items()
    ]
    checks += [
        (("datasets", ds, "shards"), (d or {}).get("shards"), "max_shards", "a job and a file per shard and stage")
        for ds, d in (config.get("datasets") or {}).items()
    ]
    for path, value, bound, what in checks:
        limit = bounds.get(bound)
        if isinstance(value, int) and isinstance(limit, int) and value > limit:
            raise ConfigError(
                f"Config error: {_where(path, files)}{_dotted(path)}: {value:,} is above "
                f"bounds.{bound} ({limit:,}; {what}): lower it, or set bounds.{bound}: {value} to "
                "allow it"
            )


def validate_config(config: dict, schema: dict, *, files: Sequence[tuple[str, dict]] = ()) -> dict:
    """Check ``config`` against the JSON ``schema`` and fill in every ``default`` (in place; also returned).

    ``files``: the config files the config was merged from, as ``(name, parsed YAML)`` in merge order; each
    problem names the last one that sets the key. Raises :class:`ConfigError` with one line per problem
    (``path: what is wrong``; an unknown key gets the closest valid key at its level, "did you mean", or the
    section it belongs to), at most :data:`MAX_LISTED_PROBLEMS` of them.
    """
    all_keys = [p for p, _ in key_paths(schema)]
    errors = list(_validator(schema).iter_errors(config))
    if not errors:
        check_bounds(config, files)
        return config
    # jsonschema reports each missing required key as an error of its own; each lists them all: one problem
    problems = list({(tuple(p[0]), p[1]): p for e in errors for p in _problems(e, all_keys)}.values())
    # "missing key x" next to a misspelt key the message already corrects to x is one problem, not two
    fixed = {(tuple(map(str, path[:-1])), sug) for path, _, sug in problems if sug}
    problems = [
        p
        for p in problems
        if not any(tuple(map(str, p[0])) == at and p[1].endswith(f" {sug} (it has no default)") for at, sug in fixed)
    ]
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
