"""Counterfactual re-batching: which of a run's completed groups another admission rule would train.

The run's full stream of completed groups (the ones it trained and the ones it dropped) is judged
again against its recorded version timeline: each group at the version that was current when it
completed (the last one published before it), by the trainer's own filters
(`trainer.staleness.admissible`, `trainer.advantages.informative`, the token check) under the
counterfactual settings. Advantages come from `trainer.advantages.group_advantages`, as online.

The timeline is the recorded one: admitting more or fewer groups would have changed when versions
were published, which no re-batching can know. So this answers "which groups would this rule have
let through, given what happened", the question behind choosing eta or a filter.
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

import duckdb

from trainer.advantages import group_advantages, informative
from trainer.staleness import admissible

Filter = Literal["dynamic", "none", "raft"]

GROUPS = """
    select g.group_id, g.trajectory_ids, g.rewards, g.outcomes, g.min_policy_version, epoch(g.completed_at) as t,
           coalesce(max(s.response_tokens), 0) > 0 as has_tokens
    from groups g left join steps s on s.run_id = g.run_id and list_contains(g.trajectory_ids, s.trajectory_id)
    where g.run_id = $run
    group by all order by t, g.group_id"""
VERDICTS = "select trajectory_id, success from verdicts where run_id = $run and judge = $judge"
VERSIONS = "select version, epoch(published_at) from policy_versions where run_id = $run order by 2, 1"
RECORDED = """
    select 'trained', count(distinct g) from (select unnest(group_ids) as g from updates where run_id = $run)
    union all
    select reason, count(*) from dropped_groups where run_id = $run group by reason"""


@dataclass(frozen=True)
class Admission:
    eta: int = 2
    """Staleness bound: a group is admitted at version v iff its oldest token's version is >= v - eta."""
    filter: Filter = "dynamic"
    """`dynamic`: drop all-equal rewards (dynamic sampling); `none`: keep them; `raft`: successes only."""
    judge: str | None = None
    """Rewards from this judge's verdicts (the `verdicts` view: success 1, failure 0, e.g. after `awrl
    rejudge`); a group with a trajectory it gave no verdict on is dropped as `judge_error`, as the
    trainer drops one. None: the rewards the run recorded."""


@dataclass
class Rebatch:
    run_id: str
    admission: Admission
    groups: int = 0
    admitted: list[str] = field(default_factory=list)
    dropped: dict[str, int] = field(default_factory=dict)
    """Reason (`judge_error`, `no_tokens`, `uninformative`, `stale`) -> groups."""
    per_version: dict[int, int] = field(default_factory=dict)
    """Version current at completion -> groups admitted then (the effective batch supply per update)."""
    staleness: dict[int, int] = field(default_factory=dict)
    """Version lag (current - oldest token version) -> admitted groups."""
    advantages: list[float] = field(default_factory=list)
    """Every admitted trajectory's group advantage."""
    recorded: dict[str, int] = field(default_factory=dict)
    """What the run itself did: groups trained and dropped by reason."""


def rebatch(con: duckdb.DuckDBPyConnection, run_id: str, admission: Admission = Admission()) -> Rebatch:
    versions = con.execute(VERSIONS, {"run": run_id}).fetchall()
    times = [t for _, t in versions]
    out = Rebatch(run_id, admission, recorded=dict(con.execute(RECORDED, {"run": run_id}).fetchall()))
    dropped, per_version, staleness = Counter(), Counter(), Counter()
    verdicts = (
        dict(con.execute(VERDICTS, {"run": run_id, "judge": admission.judge}).fetchall()) if admission.judge else None
    )
    for group_id, tids, rewards, outcomes, oldest, t, has_tokens in con.execute(GROUPS, {"run": run_id}).fetchall():
        out.groups += 1
        i = bisect.bisect_right(times, t) - 1
        current = versions[i][0] if i >= 0 else 0
        if verdicts is not None:
            judged = [verdicts.get(tid) for tid in tids]
            outcomes = ["judge_error" if v is None else "judged" for v in judged]
            rewards = [float(bool(v)) for v in judged]
        reason = "judge_error" if "judge_error" in outcomes else None
        reason = reason or _rejection(rewards, oldest, current, has_tokens, admission)
        if reason:
            dropped[reason] += 1
            continue
        out.admitted.append(group_id)
        per_version[current] += 1
        staleness[current - oldest] += 1
        out.advantages += group_advantages(rewards)
    out.dropped, out.per_version, out.staleness = (
        dict(dropped),
        dict(sorted(per_version.items())),
        dict(sorted(staleness.items())),
    )
    return out


def _rejection(rewards: list[float], oldest: int, current: int, has_tokens: bool, a: Admission) -> str | None:
    """The trainer's filters, in the trainer's order (`trainer.batch.BatchBuilder`)."""
    if not has_tokens:
        return "no_tokens"
    if (a.filter == "raft" and max(rewards) <= 0) or (a.filter == "dynamic" and not informative(rewards)):
        return "uninformative"
    if not admissible([oldest], current, a.eta):
        return "stale"
    return None
