"""Snakemake logger plugin ``eagle3``: the console of a workflow run, on which the run-wide view draws.

Snakemake 9 finds it by its module name (``snakemake_logger_plugin_<name>``, its logger plugin registry) and uses it
with ``--logger eagle3``; the workflow profile (``profiles/default/config.yaml``: ``logger: [eagle3]``) turns it on
for every ``snakemake`` run in the workflow's directory. It writes Snakemake's messages as Snakemake's own console
handler does (Snakemake's formatter and filter, attached by Snakemake since this handler has none of its own; the
same colours on a terminal), with one difference: each message goes to the process's ``sys.stderr`` (``sys.stdout``
for a dry run) *as it is when the message is written*, not a stream held since the start. While the run-wide view's
live table is up (:mod:`eagle3_data.runtime.runview`), rich's stand-in for ``sys.stderr`` is there, so Snakemake's
messages scroll above the table like everything else the main process prints; nothing of Snakemake's is re-pointed.

Snakemake hands records to logger plugins through a queue, in a thread of its own: the run-wide view asks the handler
to :meth:`LogHandler.drain` before it stops, so the table's last state and the run's last screen come after every
message Snakemake logged before them.

It also keeps Snakemake's account of the run's jobs (:attr:`LogHandler.jobs`, an
:class:`eagle3_data.runtime.stageview.JobTally`: the jobs of each rule in the run, each job's start, end and
failure, from every record Snakemake logs, whether or not its filter shows it), from which the run-wide view shows
the stages after generation.

Only the main ``snakemake`` process has it: Snakemake starts no logger plugin in a job's process
(``skip_plugin_handlers`` in its subprocess and remote modes). The handler attaches itself to the run-wide view
(:func:`eagle3_data.runtime.runview.attach_console`): without it (``--logger`` naming another plugin, no workflow
profile), the view prints plain lines, never a live table.

The handler is in :mod:`.handler`; Snakemake's plugin registry finds it here by its name, ``LogHandler``.
"""

from .handler import LogHandler  # noqa: F401 (Snakemake's plugin registry reads it here)
