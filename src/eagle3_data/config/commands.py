"""Which ``snakemake`` command lines run no job: they read the workflow and the files it made (a report, a
summary, a graph) and send no request, so the config checks leave out the API keys for them
(``rules/common.smk``)."""

from __future__ import annotations

from collections.abc import Sequence

#: options of the ``snakemake`` modes that run no job (snakemake/cli.py): they print, draw or list the workflow,
#: write the report of what the build made, or tidy Snakemake's own records; ``--report-after-run`` runs the
#: build first and is left out (:func:`runs_no_job`)
NO_JOB_OPTIONS = frozenset(
    {
        "--report",
        "--lint",
        "--unlock",
        "--summary",
        "-S",
        "--detailed-summary",
        "-D",
        "--list-rules",
        "--list",
        "-l",
        "--list-target-rules",
        "--lt",
        "--dag",
        "--rulegraph",
        "--filegraph",
        "--d3dag",
        "--list-changes",
        "--lc",
        "--list-input-changes",
        "--li",
        "--list-params-changes",
        "--lp",
        "--list-untracked",
        "--lu",
        "--print-compilation",
        "--containerize",
        "--export-cwl",
        "--generate-unit-tests",
        "--archive",
        "--cleanup-metadata",
        "--cm",
        "--cleanup-shadow",
        "--delete-all-output",
        "--delete-temp-output",
        "--list-conda-envs",
        "--conda-cleanup-envs",
        "--container-cleanup-images",
    }
)


def runs_no_job(argv: Sequence[str]) -> bool:
    """Whether the ``snakemake`` command line ``argv`` (``sys.argv``: the program first) is a mode of
    :data:`NO_JOB_OPTIONS`, which runs no job and sends no request: ``snakemake --report report.html`` and
    ``snakemake --summary`` are; ``snakemake --cores 2`` and ``snakemake --report-after-run --report r.html``
    (it builds first) are not. An option given as ``--opt=value`` counts as ``--opt``."""
    options = {str(a).split("=", 1)[0] for a in list(argv)[1:]}
    return "--report-after-run" not in options and bool(options & NO_JOB_OPTIONS)
