"""Which snakemake command lines run no job (eagle3_data.config.commands): the config checks ask for the API keys
only where jobs may send requests."""

from __future__ import annotations

import pytest

from eagle3_data.config.commands import NO_JOB_OPTIONS, runs_no_job


@pytest.mark.parametrize(
    "args",
    [
        ["--report", "report.html"],
        ["--report=report.html", "--configfile", "my.yaml"],
        ["--configfile", "my.yaml", "--report"],
        ["--summary"],
        ["-S"],
        ["--detailed-summary"],
        ["--rulegraph"],
        ["--dag"],
        ["--list-changes", "params"],
        ["--lint"],
        ["--unlock"],
        ["--list-rules"],
        ["--cleanup-metadata", "results/reports/tally.md"],
    ],
)
def test_modes_that_run_no_job(args):
    assert runs_no_job(["snakemake", *args])


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["--cores", "2"],
        ["forecast", "--cores", "2", "--configfile", "my.yaml"],
        ["--cores", "8", "--until", "merge"],
        ["-n"],  # a dry run: the config checks warn about a missing key (rules/common.smk), not this
        ["--report-after-run", "--report", "report.html", "--cores", "2"],  # the build runs first
        ["--cores", "2", "--configfile", "report.yaml"],  # a value that only looks like a mode
        ["--cores", "2", "results/reports/summary"],
    ],
)
def test_commands_that_run_jobs(args):
    assert not runs_no_job(["snakemake", *args])


def test_the_program_name_is_not_read_as_an_option():
    assert not runs_no_job(["--report"])  # argv[0]: the program
    assert all(o.startswith("-") for o in NO_JOB_OPTIONS)
