"""Rule decontamination_report: ``results/reports/decontamination.{md,csv}`` from the decontaminate stage's outputs
(``sql/decontamination.sql``): per dataset the prompts checked and kept, and per reason what they matched (the
benchmark, or the dataset whose prompt they nearly duplicate: the pairs of datasets), by which rule and, for the
n-gram rule, one n-gram a prompt shares with its item (to tell a copied item from shared boilerplate)."""

from __future__ import annotations

from pathlib import Path

from .. import sql
from ..files import atomic_path, write_text

COLUMNS = ["dataset", "checked", "kept", "reason", "against", "rule", "prompts", "items", "example"]


def write_report(kept_paths, rejected_paths, md_path, csv_path) -> list[dict]:
    """Write the report; returns its rows (dicts of :data:`COLUMNS`; a dataset without rejects has one row with
    reason None)."""
    import duckdb

    from ..report.markdown import markdown_table

    if not kept_paths or not rejected_paths:  # no dataset with prompts (all pre-tokenized): nothing was checked
        write_text("# Decontamination\n\nNo dataset with prompts: nothing was checked.\n", md_path)
        write_text(",".join(COLUMNS) + "\n", csv_path)
        return []
    with duckdb.connect() as con:
        sql.set_variables(con, kept_files=[str(p) for p in kept_paths], rejected_files=[str(p) for p in rejected_paths])
        con.execute(f"CREATE TEMP TABLE decontamination AS {sql.load('decontamination')}")
        rows = [
            dict(zip(COLUMNS, r)) for r in con.execute(f"SELECT {', '.join(COLUMNS)} FROM decontamination").fetchall()
        ]
        Path(csv_path).parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(csv_path) as tmp:
            con.execute(f"COPY decontamination TO '{str(tmp)}' (FORMAT csv, HEADER true)")
    cols = [
        ("dataset", "Dataset", "text"),
        ("checked", "Checked", ""),
        ("kept", "Kept", ""),
        ("reason", "Reason", "text"),
        ("against", "Against", "text"),
        ("rule", "Rule", "text"),
        ("prompts", "Prompts", ""),
        ("items", "Items (first)", "text"),
        ("example", "A shared n-gram", "text"),
    ]
    shown = [{**r, "prompts": r["prompts"] if r["reason"] else None} for r in rows]
    write_text("# Decontamination\n\n" + markdown_table(shown, cols) + "\n", md_path)
    return rows
