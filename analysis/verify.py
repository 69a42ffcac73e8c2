"""What the ledger promises, checked: every event once, every step of a trajectory, versions without
gaps, and nothing left in a producer's outbox.

    con = connect(settings, run_id="run-7")
    for finding in verify(con, "run-7", settings.outbox_dir):
        print(finding.line())

Each check is one query, `analysis/sql/verify_<kind>.sql`, returning one row per violation: `awrl
ledger verify` runs them all, and the Dagster asset checks (`assets.checks`) run the same ones through
`check`, so the two can never disagree. The views read each event id once (`analysis.views`), so
duplicates are counted in the stored rows (`duplicate_events`), not in the views.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass, field
from pathlib import Path

import duckdb

from analysis.views import load_sql

CHECKS: dict[str, str] = {
    "duplicates": "event ids stored more than once",
    "missing_steps": "trajectories with a step missing",
    "version_gaps": "published versions out of sequence",
}
"""The ledger's checks, by kind (`analysis/sql/verify_<kind>.sql`), with what a row of each is."""
OUTBOX = "unconfirmed_outbox"
OUTBOX_WHAT = "events a producer's outbox still holds"


@dataclass(frozen=True)
class Finding:
    """The rows one check found (none: it passed)."""

    kind: str
    what: str
    rows: list[dict] = field(default_factory=list)

    @property
    def count(self) -> int:
        return len(self.rows)

    def line(self) -> str:
        """`kind: count`, with the first row as an example: one line for people."""
        head = f"{self.kind.replace('_', ' ')}: {self.count}"
        if not self.rows:
            return head
        example = ", ".join(f"{k} {v}" for k, v in self.rows[0].items() if v is not None)
        return f"{head} {self.what} (e.g. {example})"


def check(con: duckdb.DuckDBPyConnection, kind: str, run_id: str | None = None) -> Finding:
    """One of `CHECKS` over the ledger's views; `run_id` None: every run."""
    return Finding(kind, CHECKS[kind], _rows(con, load_sql(f"verify_{kind}"), {"run_id": run_id}))


def verify(con: duckdb.DuckDBPyConnection, run_id: str | None = None, outbox_dir: Path | None = None) -> list[Finding]:
    """Every check, one `Finding` per kind (passed ones included, with no rows); the outboxes under
    `outbox_dir` too, when given (`StackSettings.outbox_dir`)."""
    findings = [check(con, kind, run_id) for kind in CHECKS]
    if outbox_dir is not None:
        findings.append(unconfirmed_outbox(con, outbox_dir, run_id))
    return findings


def unconfirmed_outbox(con: duckdb.DuckDBPyConnection, outbox_dir: Path, run_id: str | None = None) -> Finding:
    """The events the outbox files under `outbox_dir` still hold (of `run_id`, or of every run), and
    whether the ledger has each (`verify_outbox.sql`)."""
    pending = _pending(Path(outbox_dir))
    if not pending:  # DuckDB cannot type an empty list parameter
        return Finding(OUTBOX, OUTBOX_WHAT)
    outboxes, event_ids, run_ids = map(list, zip(*pending, strict=True))
    return Finding(
        OUTBOX,
        OUTBOX_WHAT,
        _rows(
            con,
            load_sql("verify_outbox"),
            {"outboxes": outboxes, "event_ids": event_ids, "run_ids": run_ids, "run_id": run_id},
        ),
    )


def _pending(outbox_dir: Path) -> list[tuple[str, str, str | None]]:
    """(outbox file, event id, run id) of every event in the outboxes (`pipeline.outbox`'s `pending`
    table), opened read-only: a producer may be using them, and a check must change nothing."""
    found = []
    for path in sorted(outbox_dir.glob("*.sqlite")):
        db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
        try:
            found += [
                (path.name, event_id, run)
                for event_id, run in db.execute(
                    "SELECT event_id, json_extract(CAST(value AS TEXT), '$.run_id') FROM pending"
                )
            ]
        finally:
            db.close()
    return found


def _rows(con: duckdb.DuckDBPyConnection, query: str, params: dict) -> list[dict]:
    cur = con.execute(query, params)
    columns = [d[0] for d in cur.description]
    return [dict(zip(columns, row, strict=True)) for row in cur.fetchall()]


def judge_errors(con: duckdb.DuckDBPyConnection, run_id: str | None = None) -> int:
    """Trajectories the judge that gives the reward gave no verdict on (`judge_error`): not a fault of
    the ledger, so no check fails on them, but `awrl ledger verify` says how many (their groups were
    dropped)."""
    (n,) = con.execute(
        "SELECT count(*) FROM verdicts WHERE gives_reward AND success IS NULL AND ($run IS NULL OR run_id = $run)",
        {"run": run_id},
    ).fetchone()
    return n
