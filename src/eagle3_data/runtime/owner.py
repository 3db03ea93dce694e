"""Which config built a dataset's files: one build per dataset directory, never two configs mixed in it.

Every stage writes ``results/<dataset>/...`` and the merged set, reports and exports under ``results/``. Two
configs that name the same dataset (the shipped ``resources/configs/openrouter.yaml`` and
``resources/configs/real-small.yaml`` both name ``sharegpt``) would otherwise read and overwrite each other's
files: a forecast or a run's last screen would count the other config's build.

A run records, per dataset, the config file that defines it (the first of the run's ``--configfile`` files that
sets ``datasets.<name>``; a file layered on it that only changes some keys keeps it) in
``results/<dataset>/.built-by.json`` (:func:`record`, from the Snakefile's ``onstart``). Before any job runs, also
on a dry run, :func:`check` refuses a config whose dataset directory was built by another file, with one line
saying how to keep both builds.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from ..config import ConfigError

#: the marker of a dataset's directory: ``{"config": <file>, "dataset": <name>}``
MARKER = ".built-by.json"


def defining_files(datasets: Sequence[str], files: Sequence[tuple[str, dict]]) -> dict[str, str]:
    """Dataset name -> the first config file (of ``files``: ``(path, parsed YAML)`` in merge order, as
    :func:`eagle3_data.config.config_sources` gives them) that sets ``datasets.<name>``. A dataset no file names
    is left out."""
    out: dict[str, str] = {}
    for name, tree in files:
        for ds in ((tree or {}).get("datasets") or {}) if isinstance(tree, dict) else {}:
            if ds in datasets:
                out.setdefault(ds, name)
    return out


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.normpath(a) == os.path.normpath(b)


def check(datasets: Sequence[str], files: Sequence[tuple[str, dict]], results_dir: str | os.PathLike = "results"):
    """Raise :class:`ConfigError` (one line) when a dataset's directory under ``results_dir`` was built by a
    config file other than the one that defines it now (its :data:`MARKER`). Directories without a marker (a
    build before this check, or none yet) pass."""
    for ds, mine in defining_files(datasets, files).items():
        marker = Path(results_dir) / ds / MARKER
        try:
            theirs = json.loads(marker.read_text())["config"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if not _same_file(theirs, mine):
            raise ConfigError(
                f"Config error: {results_dir}/{ds}/ holds dataset {ds} as {theirs} defines it, not as {mine} "
                f"does: their files would mix. Keep that build by moving it aside first (mv {results_dir} "
                f"{results_dir}.{Path(theirs).stem}; mv logs logs.{Path(theirs).stem}), or, if {mine} is meant "
                f"to carry on that build, delete {marker}"
            )


def record(datasets: Sequence[str], files: Sequence[tuple[str, dict]], results_dir: str | os.PathLike = "results"):
    """Write each dataset's :data:`MARKER` (creating its directory): the config file that defines it."""
    for ds, mine in defining_files(datasets, files).items():
        d = Path(results_dir) / ds
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f"{MARKER}.tmp"
        tmp.write_text(json.dumps({"config": mine, "dataset": ds}) + "\n")
        os.replace(tmp, d / MARKER)
