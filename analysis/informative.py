"""How many of a run's groups teach the trainer anything: the share of groups whose rewards are not all
equal (dynamic sampling drops the others) and informative groups per minute, from the ledger.

    informative_groups(connect(settings, run_id="r1"), "r1")  # -> InformativeGroups(groups=..., ...)

The query is `analysis/sql/informative_groups.sql`, over the `groups` view (whose `informative` column
is `trainer.advantages.informative`, what the batch builder keeps).
"""

from __future__ import annotations

from dataclasses import dataclass

import duckdb

from analysis.views import load_sql


@dataclass(frozen=True)
class InformativeGroups:
    groups: int
    """Completed groups of the run."""
    informative: int
    """Of them, groups whose rewards are not all equal."""
    share: float | None
    """informative / groups (None without groups)."""
    minutes: float | None
    """The run's sampling span: its first dispatched group to its last completed one."""
    per_minute: float | None
    """Informative groups per minute of that span."""


def informative_groups(con: duckdb.DuckDBPyConnection, run_id: str) -> InformativeGroups:
    groups, informative, share, minutes, per_minute = con.execute(
        load_sql("informative_groups"), {"run_id": run_id}
    ).fetchone()
    if not groups:
        return InformativeGroups(0, 0, None, None, None)
    return InformativeGroups(groups, informative, share, minutes, per_minute if minutes else None)
