"""The runs of a ledger (the `runs` view), and the one check every per-run verb makes first."""

from __future__ import annotations

import json

import duckdb


class UnknownRun(LookupError):
    """A run id with no event in the ledger (mistyped, or not yet synced)."""

    def __init__(self, run_id: str, known: list[str]):
        hint = f"; recent runs: {', '.join(known)}" if known else "; the ledger has no runs yet (`awrl ledger sync`?)"
        super().__init__(f"no run {run_id!r} in the ledger{hint} (`awrl runs` lists them)")


def require_run(con: duckdb.DuckDBPyConnection, run_id: str) -> None:
    """Raise `UnknownRun` unless the ledger holds events of `run_id`."""
    _run_row(con, run_id, "run_id")


def run_config(con: duckdb.DuckDBPyConnection, run_id: str) -> tuple[str, dict] | None:
    """(command, resolved config) of the run's first `RunStarted`; None for a run that recorded none."""
    command, config_json = _run_row(con, run_id, "command, config_json")
    return None if command is None else (command, json.loads(config_json))


def _run_row(con: duckdb.DuckDBPyConnection, run_id: str, columns: str) -> tuple:
    row = con.execute(f"SELECT {columns} FROM runs WHERE run_id = $r", {"r": run_id}).fetchone()
    if row is None:
        recent = con.execute("SELECT run_id FROM runs ORDER BY started_at DESC LIMIT 5").fetchall()
        raise UnknownRun(run_id, [r for (r,) in recent])
    return row
