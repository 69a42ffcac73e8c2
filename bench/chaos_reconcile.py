"""The chaos soak's reconciliation (`bench/chaos.py`): what the ledger holds after the soak, checked
against what the producers sent and what the trainer trained.

- every event a producer handed to its outbox (acknowledged or not) is in the ledger: the outboxes
  are empty, and no trajectory in the ledger misses a step below its last;
- no event is in the ledger twice, counted in the stored rows (`read_events` and the views read each
  event id once, so they would hide a row written twice); `awrl ledger verify`'s findings are listed too;
- every completed group was trained once, dropped with a reason, or is still open (never twice);
- no group was trained with a step missing: every step its announcement names is in the ledger, and
  its update scored as many response tokens as those steps carry (a trainer that had a step fewer,
  overtaken by its announcement after a broker lost it, scores fewer);
- no group is open at the end past its timeout: the staleness bound, after which the trainer drops a
  group (`stale`, or `steps_missing` for one still waiting for a step) rather than hold it;
- every published version has its checkpoint in the store.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from analysis import connect
from analysis.verify import verify
from pipeline.checkpoints import CheckpointStore
from pipeline.ledger import read_events, stored_event_ids
from pipeline.settings import StackSettings
from trainer.staleness import admissible

EVENT_TYPES = (
    "StepRecorded",
    "EpisodeFinished",
    "GroupCompleted",
    "GroupDropped",
    "UpdateApplied",
    "PolicyVersionPublished",
    "EpisodeStarted",
    "TaskGroupDispatched",
    "PolicyVersionLoaded",
)


@dataclass
class Reconciliation:
    seed: int
    faults: list[tuple[float, str]]
    events: int = 0
    duplicated: int = 0
    left_in_outboxes: int = 0
    resent_at_drain: int = 0
    """Events the restarted producers sent again at the end (never acknowledged, another broker's, or,
    after half the drain, unconfirmed for 30 s: the outbox's last resort, here not after 10 min)."""
    left_but_in_ledger: int = 0
    """Of those, in the ledger all the same (a receipt that never came), as opposed to not yet written."""
    trajectories: int = 0
    missing_steps: int = 0
    groups: int = 0
    trained: int = 0
    trained_twice: int = 0
    trained_with_missing_step: int = 0
    """Trained groups with a step their announcement names not in the ledger, or in an update that
    scored fewer response tokens than the ledger's steps of its trajectories carry."""
    dropped: int = 0
    dropped_without_reason: int = 0
    dropped_steps_missing: int = 0
    """Of `dropped`, groups whose announcement overtook a step that then never came in time."""
    open_groups: int = 0
    open_past_timeout: int = 0
    """Of `open_groups`, those whose oldest step is outside the staleness bound at the last published
    version: by then the trainer should have trained or dropped them."""
    open_past_timeout_groups: list[str] = field(default_factory=list)
    """Those groups, each with its oldest version, announcements and steps in the ledger (to diagnose)."""
    updates: int = 0
    """Updates in a published version's lineage."""
    updates_lost: int = 0
    """Updates no published version names: lost with a killed trainer, or after its last version."""
    versions: int = 0
    versions_without_checkpoint: int = 0
    versions_twice: int = 0
    """Version numbers published by two different events (a trainer that resumed from too early)."""
    restarts: dict[str, int] = field(default_factory=dict)
    verified: list[str] = field(default_factory=list)
    """`awrl ledger verify`'s line per check, on the run's ledger."""
    stalled: str = ""
    """Why the soak stopped early: the system made no progress for its patience (a failure)."""
    logs: dict[str, list[str]] = field(default_factory=dict)
    """The last lines of each service's log, shown when a check failed."""

    @property
    def ok(self) -> bool:
        return not (
            self.stalled
            or self.duplicated
            or self.left_in_outboxes
            or self.missing_steps
            or self.trained_twice
            or self.trained_with_missing_step
            or self.dropped_without_reason
            or self.open_past_timeout
            or self.versions_without_checkpoint
            or self.versions_twice
        )

    def lines(self) -> list[str]:
        drawn = Counter(f for _, f in self.faults)
        return [
            f"seed {self.seed}: {len(self.faults)} faults ({', '.join(f'{k} {v}' for k, v in sorted(drawn.items()))})",
            f"events in the ledger: {self.events}, twice: {self.duplicated}; left unconfirmed in outboxes: "
            f"{self.left_in_outboxes} ({self.left_but_in_ledger} of them in the ledger); sent again at the end: "
            f"{self.resent_at_drain}",
            f"trajectories finished: {self.trajectories}, with a missing step: {self.missing_steps}",
            f"groups completed: {self.groups}: trained {self.trained} (twice: {self.trained_twice}, with a missing "
            f"step: {self.trained_with_missing_step}), dropped {self.dropped} (without a reason: "
            f"{self.dropped_without_reason}; a step never came: {self.dropped_steps_missing}), still open "
            f"{self.open_groups} (past their timeout: {self.open_past_timeout})",
            *(f"  open past its timeout: {g}" for g in self.open_past_timeout_groups[:5]),
            f"updates in a published version: {self.updates}; not (lost with a killed trainer, or after its "
            f"last version): {self.updates_lost}",
            f"versions published: {self.versions}, without a checkpoint: {self.versions_without_checkpoint}, "
            f"published twice: {self.versions_twice}",
            "services started again after dying: " + ", ".join(f"{k} {v}" for k, v in sorted(self.restarts.items())),
            *(f"awrl ledger verify: {line}" for line in self.verified),
            *([f"stalled: {self.stalled}"] if self.stalled else []),
            "reconciled: OK" if self.ok else "reconciled: FAILED",
        ]

    def report(self) -> str:
        """`lines()`, and each service's last log lines: what a failed run in CI leaves to read."""
        tails = [f"--- {name} (last lines)\n" + "\n".join(lines) for name, lines in self.logs.items()]
        return "\n".join([*self.lines(), *tails])


def reconcile(r: Reconciliation, settings: StackSettings, run_id: str, left: set[str], eta: int) -> Reconciliation:
    """Fill `r` from the run's ledger; `left`: the event ids still in the producers' outboxes; `eta`: the
    trainer's staleness bound."""
    r.left_in_outboxes = len(left)
    ids = Counter()
    tables = {}
    for event_type in EVENT_TYPES:
        t = read_events(settings, run_id, event_type).to_pylist()
        tables[event_type] = t
        ids.update(stored_event_ids(settings, run_id, event_type))
    r.events, r.duplicated = sum(ids.values()), sum(n - 1 for n in ids.values() if n > 1)
    r.left_but_in_ledger = len(left & set(ids))
    steps: dict[str, dict[int, dict]] = {}
    for s in tables["StepRecorded"]:
        steps.setdefault(s["trajectory_id"], {})[s["step"]] = s  # by number: a row twice counts once here
    finished = tables["EpisodeFinished"]
    r.trajectories = len(finished)
    r.missing_steps = sum(1 for f in finished if steps.get(f["trajectory_id"], {}).keys() != set(range(f["num_steps"])))
    completed = {g["group_id"]: g for g in tables["GroupCompleted"]}
    # Trained = in an update that a published version's lineage names. An update whose version a
    # killed trainer never published was lost with it; its groups were consumed again.
    lineage = {u for v in tables["PolicyVersionPublished"] for u in v["update_ids"]}
    kept = [u for u in tables["UpdateApplied"] if u["event_id"] in lineage]
    r.updates, r.updates_lost = len(kept), len(tables["UpdateApplied"]) - len(kept)
    trained = Counter(g for u in kept for g in u["group_ids"])
    dropped = {d["group_id"]: d.get("reason") for d in tables["GroupDropped"]}
    r.groups, r.trained = len(completed), len(completed.keys() & set(trained))
    r.trained_twice = sum(1 for n in trained.values() if n > 1)
    r.trained_with_missing_step = len(_trained_short(kept, completed, steps))
    r.dropped = len(completed.keys() & set(dropped))
    r.dropped_without_reason = sum(1 for reason in dropped.values() if not reason)
    r.dropped_steps_missing = sum(1 for g, reason in dropped.items() if reason == "steps_missing" and g in completed)
    still_open = completed.keys() - set(trained) - set(dropped)
    r.open_groups = len(still_open)
    versions = {v["version"] for v in tables["PolicyVersionPublished"] if v["version"] > 0}
    last = max(versions, default=0)
    oldest = {g: min(_behaviour_versions(completed[g], steps)) for g in still_open}
    past = [g for g in still_open if not admissible([oldest[g]], last, eta)]
    r.open_past_timeout = len(past)
    announced = Counter(g["group_id"] for g in tables["GroupCompleted"])
    r.open_past_timeout_groups = [
        f"{g} (oldest version {oldest[g]} at v{last}, announced "
        f"{announced[g]}x, steps {sum(len(steps.get(t, {})) for t in completed[g]['trajectory_ids'])} of "
        f"{sum(completed[g]['num_steps'])})"
        for g in past
    ]
    store = CheckpointStore.from_settings(settings)
    r.versions = len(versions)
    numbers = Counter(n for n, _ in {(v["version"], v["event_id"]) for v in tables["PolicyVersionPublished"]})
    r.versions_twice = sum(1 for n in numbers.values() if n > 1)
    r.versions_without_checkpoint = sum(1 for v in versions if not store.exists(run_id, v))
    r.verified = [f.line() for f in verify(connect(settings, run_id=run_id), run_id)]
    return r


def _trained_short(updates: list[dict], completed: dict[str, dict], steps: dict[str, dict[int, dict]]) -> set[str]:
    """Groups of `updates` trained with a step missing: one of their steps is not in the ledger, or
    their update scored fewer response tokens (its `tokens` statistic, every live sample's) than the
    ledger's steps of its trajectories carry."""
    short = set()
    for u in updates:
        groups = [completed[g] for g in u["group_ids"] if g in completed]
        short |= {
            g["group_id"]
            for g in groups
            if any(not set(range(n)) <= steps.get(t, {}).keys() for t, n in zip(g["trajectory_ids"], g["num_steps"]))
        }
        tokens = sum(len(s["response_token_ids"]) for t in u["trajectory_ids"] for s in steps.get(t, {}).values())
        if dict(u["stats"]).get("tokens", tokens) < tokens:
            short |= set(u["group_ids"])
    return short


def _behaviour_versions(group: dict, steps: dict[str, dict[int, dict]]) -> list[int]:
    """Every token's version in the group's steps (a token-less step's own), as the trainer's filter reads
    them; the announcement's oldest version for a group none of whose steps is in the ledger."""
    return [
        v
        for t in group["trajectory_ids"]
        for s in steps.get(t, {}).values()
        for v in (s["token_policy_versions"] or [s["policy_version"]])
    ] or [group["min_policy_version"]]
