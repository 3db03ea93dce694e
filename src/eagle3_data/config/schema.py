"""The config schema and its defaults: the one place a default is read from.

The schema ships inside the package (``eagle3_data/config/config.schema.yaml``, package data), so a
non-editable install validates a config from any directory.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

from .validation import key_paths, load_schema, resolve_ref

#: the workflow's config schema (JSON schema written as YAML), shipped as package data
SCHEMA_PATH = Path(__file__).resolve().with_name("config.schema.yaml")


@functools.lru_cache(maxsize=1)
def schema() -> dict:
    """The config schema (parsed once per process)."""
    return load_schema(SCHEMA_PATH)


def schema_node(path: str) -> dict:
    """The schema node of dotted key ``path`` (``"validate.count_tolerance"``, ``"target.tiny"``, ``"backends.<name>"``
    for the entry of a free-form name), ``$ref`` resolved.

    Raises KeyError naming the path when the schema has no such key.
    """
    s = schema()
    defs = s.get("$defs", {})
    node = s
    for part in path.split(".") if path else []:
        node = resolve_ref(node, defs)
        extra = node.get("additionalProperties")
        if part == "<name>" and isinstance(extra, dict):
            node = extra
            continue
        props = node.get("properties") or {}
        if part not in props:
            raise KeyError(f"config schema: no key {path!r}")
        node = props[part]
    return resolve_ref(node, defs)


@functools.lru_cache(maxsize=1)
def _defaults_table() -> dict:
    return {p: node["default"] for p, node in key_paths(schema()) if "default" in node}


def default(path: str) -> Any:
    """The schema's ``default`` of dotted key ``path`` (``<name>`` for a free-form name), a deep copy.

    Raises KeyError naming the path when the key has no default."""
    try:
        return copy.deepcopy(_defaults_table()[path])
    except KeyError:
        raise KeyError(f"config schema: no default for {path!r}") from None


def filled(path: str, value: dict | None) -> dict:
    """``value`` (the config's section at ``path``) with every key of the schema's section at ``path``: the
    config's value where set, else the schema's ``default`` (deep copy), else None; nested sections with
    properties (``count_tolerance``) filled the same way. Keys the schema doesn't know are kept."""
    node = schema_node(path)
    defs = schema().get("$defs", {})
    value = dict(value or {})
    out = {}
    for name, child in (node.get("properties") or {}).items():
        child = resolve_ref(child, defs)
        if name in value:
            v = value.pop(name)
        elif "default" in child:
            v = copy.deepcopy(child["default"])
        else:
            v = None
        if isinstance(v, dict) and child.get("properties"):
            v = filled(f"{path}.{name}" if path else name, v)
        out[name] = v
    out.update(value)
    return out
