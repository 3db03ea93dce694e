"""Report stage: DuckDB reports over the stage parquet files, as Markdown and CSV under ``results/reports/``.

Reports (file stem: what, named query in ``sql/``):

- ``tally``: the per-dataset table: samples, prompt/completion/total tokens, source
  (local/remote/mixed), pre-tokenized datasets listed apart, totals (``tally.sql``);
- ``rejects``: rejected samples by dataset, stage and reason (``rejects_by_reason.sql``);
- ``cost``: responses, billed tokens and dollars by dataset, backend and provider, $ per million tokens
  (``cost.sql``);
- ``throughput``: completion tokens per minute, cost and the running mean completion length over the
  responses' ``completed_at`` (``throughput.sql``);
- ``limits``: which limit ended each generated dataset, from generate's per-shard summary JSON when present
  (``limits.sql``);
- ``audit``: billed against the target's own token counts per dataset and ids source: completion tokens, and
  the prompt as the target template renders it vs the billed prompt (a gap = the server saw another prompt)
  (``audit.sql``).

Every query reads the views of ``sql/report_views.sql``, so a user can run it by hand in the ``duckdb`` CLI
(see each file's header). :func:`write_reports` writes them all; :func:`tally` only the first two.

Each report is written three ways: CSV (every column, exact values: DuckDB ``COPY``), Markdown (the readable
columns, formatted: ``tabulate``) and HTML (that Markdown rendered by ``markdown-it-py`` into a small
self-contained page, which ``snakemake --report`` shows in its page; a CSV would only be a download there).

The stage lives in modules named for what they do; this package re-exports every name the single ``report``
module used to define, so ``from eagle3_data.report import X`` still works:

- :mod:`.outputs` - the CSV columns of each report and rule report's outputs (:data:`RULE_OUTPUTS`,
  :data:`REPORT_FILES`);
- :mod:`.db` - :func:`open_report_db` (the DuckDB views every query reads), :func:`query`, :func:`write_csv`,
  :func:`backend_location`;
- :mod:`.markdown` - the Markdown tables (:func:`markdown_table`, ``format_*``) and HTML pages
  (:func:`markdown_page`, :func:`front_page_fragment`);
- :mod:`.write` - rule report's job: :func:`tally` and :func:`write_reports`;
- :mod:`.summary` - the run's last lines: :func:`run_summary`, :func:`run_summary_rows`, :func:`pilot_spend`.
"""

from __future__ import annotations

from .outputs import (  # noqa: F401
    AUDIT_COLUMNS,
    COST_COLUMNS,
    LIMIT_COLUMNS,
    PLOT_STEMS,
    REJECT_COLUMNS,
    REPORT_FILES,
    REPORT_STEMS,
    RULE_OUTPUTS,
    TALLY_COLUMNS,
    THROUGHPUT_COLUMNS,
)
from .db import (  # noqa: F401
    SUMMARY_COLUMNS,
    backend_location,
    open_report_db,
    query,
    summary_paths_for,
    write_csv,
)
from .markdown import (  # noqa: F401
    FRONT_PAGE,
    FRONT_STEMS,
    PAGE_CSS,
    format_audit,
    format_cost,
    format_limits,
    format_rejects,
    format_tally,
    format_throughput,
    front_page_fragment,
    markdown_page,
    markdown_table,
    write_markdown,
)
from .write import (  # noqa: F401
    MAX_MD_BUCKETS,
    MD_BUCKETS_S,
    log,
    md_bucket_s,
    tally,
    write_reports,
)
from .summary import (  # noqa: F401
    RUN_SUMMARY_COLUMNS,
    pilot_spend,
    run_summary,
    run_summary_rows,
)
