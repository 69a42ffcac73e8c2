"""Lineage of a checkpoint: which updates, trajectories, tasks and behaviour versions produced it.

Version v of a run descends from version 0 through `parent_version` links (PolicyVersionPublished);
each link names the `UpdateApplied` events that made it (`update_ids`), each update names its batch
(trajectory ids), and each trajectory its task and the policy versions that sampled its steps.
Everything is read from the ledger's views, so the answer is the recorded history, not a re-derivation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import duckdb

CHAIN = """
    with recursive chain(version, parent_version, update_ids, depth) as (
        select version, parent_version, update_ids, 0 from policy_versions where run_id = $run and version = $v
        union all
        select p.version, p.parent_version, p.update_ids, c.depth + 1
        from policy_versions p join chain c on p.version = c.parent_version
        where p.run_id = $run and c.depth < 100000
    )
    select version, update_ids from chain order by version"""
UPDATES = """
    select update_step, version_before, version_after, event_id, trajectory_ids, loss, grad_norm
    from updates where run_id = $run and list_contains($ids, event_id) order by update_step"""
BEHAVIOUR = """
    select policy_version, count(*) from steps
    where run_id = $run and list_contains($ids, trajectory_id) group by all order by 1"""
TASKS = """
    select task_id, outcome, count(*) from trajectories
    where run_id = $run and list_contains($ids, trajectory_id) group by all"""


@dataclass
class Lineage:
    run_id: str
    version: int
    versions: list[int] = field(default_factory=list)
    """The chain from the first version to `version`, oldest first."""
    updates: list[dict] = field(default_factory=list)
    """The `UpdateApplied` events along the chain (update step, versions, event id, batch size, loss)."""
    trajectories: list[str] = field(default_factory=list)
    tasks: dict[str, int] = field(default_factory=dict)
    """Task id -> trajectories of that task trained on."""
    outcomes: dict[str, int] = field(default_factory=dict)
    behaviour_versions: dict[int, int] = field(default_factory=dict)
    """Policy version -> steps it sampled among the trained trajectories."""


def lineage(con: duckdb.DuckDBPyConnection, run_id: str, version: int) -> Lineage:
    """The recorded lineage of `version` of `run_id`; KeyError if the run never published it."""
    chain = con.execute(CHAIN, {"run": run_id, "v": version}).fetchall()
    if not chain:
        raise KeyError(f"run {run_id!r} has no published version {version}")
    out = Lineage(run_id, version, versions=[v for v, _ in chain])
    update_ids = [u for _, ids in chain for u in ids or []]
    rows = con.execute(UPDATES, {"run": run_id, "ids": update_ids}).fetchall()
    for step, before, after, event_id, tids, loss, grad_norm in rows:
        out.updates.append(
            {
                "update_step": step,
                "version_before": before,
                "version_after": after,
                "event_id": event_id,
                "trajectories": len(tids),
                "loss": loss,
                "grad_norm": grad_norm,
            }
        )
        out.trajectories += tids
    params = {"run": run_id, "ids": out.trajectories}
    out.behaviour_versions = dict(con.execute(BEHAVIOUR, params).fetchall())
    for task_id, outcome, n in con.execute(TASKS, params).fetchall():
        out.tasks[task_id] = out.tasks.get(task_id, 0) + n
        out.outcomes[outcome] = out.outcomes.get(outcome, 0) + n
    return out
