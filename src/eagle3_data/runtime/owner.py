"""Which config built a dataset's files: one build per dataset directory, never two configs mixed in it.

Every stage writes ``results/<dataset>/...`` and the merged set, reports and exports under ``results/``. Two
configs that name the same dataset (the shipped ``resources/configs/openrouter.yaml`` and
``resources/configs/real-small.yaml`` both name ``sharegpt``) would otherwise read and overwrite each other's
files: a forecast or a run's last screen would count the other config's build.

A run records, per dataset, the target it builds the dataset for (``target.path``) and the config file that
defines the dataset (the first of the run's ``--configfile`` files that sets ``datasets.<name>``) in
``results/<dataset>/.built-by.json`` (:func:`record`, from the Snakefile's ``onstart``). Before any job runs, also
on a dry run, :func:`check` refuses a config that builds a dataset of that name for another target: its replies,
token ids and states are another build's. The same target from another file (a copy of the config with a dataset
added, an overlay) carries the build on. The refusal is one line saying how to keep both builds.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from ..config import ConfigError

#: the marker of a dataset's directory: ``{"config": <file>, "dataset": <name>, "target": <target.path>}``
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


def _same_path(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.normpath(a) == os.path.normpath(b)


def check(
    datasets: Sequence[str],
    files: Sequence[tuple[str, dict]],
    target: str,
    results_dir: str | os.PathLike = "results",
) -> None:
    """Raise :class:`ConfigError` (one line) when a dataset's directory under ``results_dir`` was built for a
    target other than ``target`` (``target.path``; its :data:`MARKER`). Directories without a marker, or whose
    marker names no target, pass."""
    for ds, mine in defining_files(datasets, files).items():
        marker = Path(results_dir) / ds / MARKER
        try:
            built = json.loads(marker.read_text())
            theirs, their_target = str(built["config"]), built.get("target")
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if their_target is None or _same_path(str(their_target), str(target)):
            continue
        stem = Path(theirs).stem
        raise ConfigError(
            f"Config error: {results_dir}/{ds}/ holds dataset {ds} built for target {their_target} (by {theirs}); "
            f"{mine} builds it for {target}: their files would mix. Keep that build by moving it aside first "
            f"(mv {results_dir} {results_dir}.{stem}; mv logs logs.{stem}), or, to rebuild it here for {target}, "
            f"delete {marker}"
        )


def record(
    datasets: Sequence[str],
    files: Sequence[tuple[str, dict]],
    target: str,
    results_dir: str | os.PathLike = "results",
) -> None:
    """Write each dataset's :data:`MARKER` (creating its directory): the config file that defines it and the
    target it is built for."""
    for ds, mine in defining_files(datasets, files).items():
        d = Path(results_dir) / ds
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f"{MARKER}.tmp"
        tmp.write_text(json.dumps({"config": mine, "dataset": ds, "target": str(target)}) + "\n")
        os.replace(tmp, d / MARKER)
