"""Named DuckDB queries used by merge and report.

Each ``<name>.sql`` file reads its inputs from DuckDB variables (``getvariable('validated_files')`` ...), so
a user can run it by hand in the ``duckdb`` CLI after ``SET VARIABLE``; its header says which variables.
"""

from __future__ import annotations

from pathlib import Path

SQL_DIR = Path(__file__).resolve().parent


def load(name: str) -> str:
    """Text of ``sql/<name>.sql``; raises ``FileNotFoundError`` naming the path if it does not exist."""
    path = SQL_DIR / f"{name}.sql"
    if not path.is_file():
        raise FileNotFoundError(f"no named query {name!r}: {path} does not exist")
    return path.read_text()


def set_variables(con, **values) -> None:
    """``SET VARIABLE name = value`` on DuckDB connection ``con`` for each keyword (values bound as parameters).

    Lists of strings are bound as ``VARCHAR[]`` (``None`` stays a typed NULL list); a dict becomes
    ``MAP(VARCHAR, BIGINT)``; other values are bound as they are.
    """
    for name, value in values.items():
        if not name.isidentifier():
            raise ValueError(f"bad variable name {name!r}")
        if isinstance(value, dict):
            con.execute(
                f"SET VARIABLE {name} = MAP(?::VARCHAR[], ?::BIGINT[])",
                [list(map(str, value.keys())), [int(v) for v in value.values()]],
            )
        elif value is None or isinstance(value, (list, tuple)):
            con.execute(f"SET VARIABLE {name} = ?::VARCHAR[]", [None if value is None else [str(v) for v in value]])
        else:
            con.execute(f"SET VARIABLE {name} = ?", [value])
