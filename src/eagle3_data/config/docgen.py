"""The generated parts of ``docs/config.md``: the config reference (from the schema the package ships, ``eagle3_data/config/config.schema.yaml``) and
what a change of each key reruns (from :data:`eagle3_data.config.RERUNS`).

``python -m eagle3_data.config.docgen [docs/config.md [SCHEMA]]`` rewrites the text between the
markers of that file; ``tests/unit/test_config.py`` checks that the file equals this module's output.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from . import RERUNS, key_paths

REFERENCE_START = "<!-- config-reference:start -->"
REFERENCE_END = "<!-- config-reference:end -->"
RERUNS_START = "<!-- reruns:start -->"
RERUNS_END = "<!-- reruns:end -->"


def schema_reference(schema: dict) -> str:
    """A markdown table of every config key in the JSON ``schema`` (path, type, allowed values, description),
    one row per key in schema order; ``|`` in a description is written ``/`` (it would split the cell)."""

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
        for key, word in (("minimum", ">="), ("exclusiveMinimum", ">"), ("maximum", "<="), ("exclusiveMaximum", "<")):
            if key in node:
                parts.append(f"{word} {node[key]}")
        if "default" in node:
            parts.append(f"default `{json.dumps(node['default'])}`")
        if node.get("description"):
            parts.append(node["description"])
        return "; ".join(parts)

    rows = []
    for p, node in key_paths(schema):
        if p.endswith(".<name>"):
            rows.append((p, "object", "one entry per name"))
        else:
            rows.append((p, kind(node), note(node)))
    lines = ["| key | type | values / meaning |", "|---|---|---|"]
    lines += [f"| `{p}` | {t} | {n.replace('|', '/')} |" for p, t, n in rows]
    return "\n".join(lines) + "\n"


def reruns_table() -> str:
    """:data:`eagle3_data.config.RERUNS` as a markdown table (config key, what a change of it reruns)."""
    lines = ["| config key | a change reruns |", "|---|---|"]
    lines += [f"| `{k}` | {v} |" for k, v in RERUNS]
    return "\n".join(lines) + "\n"


def _replace_between(text: str, start: str, end: str, body: str) -> str:
    if start not in text or end not in text:
        raise ValueError(f"the document has no {start} ... {end} section")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{start}\n{body}{end}{tail}"


def with_generated_tables(doc: str, schema: dict) -> str:
    """``doc`` (the text of docs/config.md) with the text between the config-reference markers replaced by
    :func:`schema_reference` of ``schema`` and the text between the reruns markers by :func:`reruns_table`.

    Raises ``ValueError`` if either pair of markers is missing.
    """
    text = _replace_between(doc, REFERENCE_START, REFERENCE_END, schema_reference(schema))
    return _replace_between(text, RERUNS_START, RERUNS_END, reruns_table())


def main(argv: list[str] | None = None) -> None:
    """``python -m eagle3_data.config.docgen [doc] [schema]``: rewrite the generated tables of ``doc`` (default
    ``docs/config.md``) from ``schema`` (default: the package's, :data:`eagle3_data.config.schema.SCHEMA_PATH`)."""
    import yaml

    args = sys.argv[1:] if argv is None else argv
    doc = Path(args[0] if args else "docs/config.md")
    from .schema import SCHEMA_PATH

    schema = Path(args[1]) if len(args) > 1 else SCHEMA_PATH
    doc.write_text(with_generated_tables(doc.read_text(), yaml.safe_load(schema.read_text())))


if __name__ == "__main__":
    main()
