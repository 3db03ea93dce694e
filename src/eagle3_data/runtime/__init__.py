"""The workflow run's machinery, apart from the stages: what one ``snakemake`` invocation shares and how it ends.

- :mod:`.run`: the run's state (its directory, owner, stop file, servers) and its end (the last line);
- :mod:`.runview`: the run-wide view on the console: generation, and the later stages (:mod:`.stageview`), from
  the jobs' progress snapshots (:mod:`.snapshots`; an extract job's: :mod:`.tokenprogress`), with the jobs' own
  terminal output kept out of its live tables (:mod:`.joboutput`);
- :mod:`.processes`: processes named by pid and start time, so a reused pid never passes for them;
- :mod:`.prerun`: the checks before any job runs (also on a dry run).

The Snakefile and ``rules/common.smk`` call it, and the generate stage joins the run through it (its servers, its
stop file; the extract stage writes its progress through it); it holds no stage logic.
"""
