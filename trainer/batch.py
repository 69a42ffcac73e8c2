"""The online batch builder: rollout events in, version-filtered batches of task groups out.

`GroupAssembler` is a pure fold over the rollout topic (tested without a broker): it buffers each
group's steps until its `GroupCompleted` has arrived and so has every step it names. Rollout events are
keyed by group id, so usually the steps come first (`pipeline.topics`); but steps a broker acknowledged
and then lost are resent by their producer's outbox seconds later, while a `GroupCompleted` sent after
the restart goes straight to the new broker and overtakes them. Such a group waits for its steps (a
resent step counts once) and is never handed out with one missing; if they have not come when it could
no longer be trained anyway (its oldest version outside the staleness bound), it is dropped as
`steps_missing`. A crashed pool re-runs a group under the same group id with new trajectories, so only
the steps of the trajectories named by `GroupCompleted` are kept; events of a group already handed out
(resends, a re-run) hold nothing back.

`BatchBuilder` runs the fold on a Kafka consumer and applies the filters, each emitting `GroupDropped`
(counted, never silent): groups with no model tokens, groups whose rewards are all equal (dynamic
sampling), groups with a screenshot that is missing from the store or no longer hashes to its key,
and groups older than the staleness bound (`trainer.staleness.admissible`, checked again when the
batch is formed, because a group may age while it waits). Offsets are committed only up to
the first group not yet trained or dropped, so a crashed trainer re-reads exactly what it had not
finished; groups it had already trained are skipped by id (`skip`).
"""

from __future__ import annotations

import logging
import random
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from pipeline.bus import EventProducer
from pipeline.consumer import Delivered, EventConsumer
from pipeline.history import ledger_groups
from pipeline.settings import StackSettings
from pipeline.store import ScreenshotCorrupted, ScreenshotMissing, ScreenshotStore
from pipeline.topics import ROLLOUT
from schemas import GroupCompleted, GroupDropped, StepRecorded
from trainer.advantages import group_advantages, informative
from trainer.config import TrainConfig
from trainer.staleness import admissible
from trainer.starvation import Starvation

Partition = tuple[str, int]
STARVING_LOG_EVERY = 8
"""The trainer's log names the cause of starvation after every this many uninformative drops in a row."""
WAITING_LOG_S = 60.0
"""While no batch is ready, the trainer says what it holds this often, and looks in the ledger for
groups the broker's log lost."""
LEDGER_AGAIN_S = 30.0
"""After the broker was found replaced, the ledger is read at once and again this much later."""
LEDGER: Partition = ("ledger", 0)
"""Where the groups read back from the ledger count as delivered: no broker offset to commit."""


log = logging.getLogger("awrl.trainer.batch")


@dataclass
class TrainGroup:
    """One completed task group, ready to train on."""

    completed: GroupCompleted
    trajectories: list[list[StepRecorded]]
    """Steps of each trajectory, in `completed.trajectory_ids` order, each sorted by step."""
    advantages: list[float]
    """A_i per trajectory (`trainer.advantages.group_advantages`, as the Dagster asset)."""
    first_offsets: dict[Partition, int]
    """Earliest log position of any of the group's events, per partition (holds back commits)."""

    @property
    def group_id(self) -> str:
        return self.completed.group_id

    def behaviour_versions(self) -> list[int]:
        """The version of every response token (the step's version for token-less steps)."""
        return [
            v for steps in self.trajectories for s in steps for v in (s.token_policy_versions or [s.policy_version])
        ]

    @property
    def has_tokens(self) -> bool:
        return any(s.response_token_ids for steps in self.trajectories for s in steps)

    def screenshot_hashes(self) -> list[str]:
        """Every screenshot the group's steps reference, each once."""
        steps = [s for trajectory in self.trajectories for s in trajectory]
        return list(dict.fromkeys(h for s in steps for h in [s.screenshot_sha256, *s.prompt_screenshot_sha256]))


def control_rewards(completed: GroupCompleted, control: str = "none") -> list[float]:
    """The rewards advantages are computed from: the group's own, or for the `shuffled_rewards` negative
    control (`TrainConfig.control`) a permutation of them seeded by the group id (so replay repeats it)."""
    if control == "none":
        return list(completed.rewards)
    if control == "shuffled_rewards":
        return random.Random(completed.group_id).sample(completed.rewards, len(completed.rewards))
    raise ValueError(f"unknown control {control!r}")


@dataclass
class _Pending:
    steps: dict[str, dict[int, StepRecorded]] = field(default_factory=lambda: defaultdict(dict))
    """Per trajectory, its steps by number (a step resent by an outbox counts once)."""
    first_offsets: dict[Partition, int] = field(default_factory=dict)
    completed: GroupCompleted | None = None
    """The group's announcement once it has come: steps it names may still be on their way."""

    def whole(self) -> bool:
        """The announcement has come, and so has every step it names."""
        c = self.completed
        return c is not None and all(
            set(range(n)) <= self.steps.get(t, {}).keys() for t, n in zip(c.trajectory_ids, c.num_steps)
        )


class GroupAssembler:
    """Fold over one run's rollout events; `add` returns a `TrainGroup` when a group is whole."""

    def __init__(self, run_id: str, control: str = "none", scale_by_std: bool = True, done: Iterable[str] = ()):
        self.run_id, self.control, self.scale_by_std = run_id, control, scale_by_std
        self._pending: dict[str, _Pending] = {}
        self._held: dict[str, dict[Partition, int]] = {}
        """Groups handed out but not yet trained or dropped: their positions hold back commits."""
        self._next: dict[Partition, int] = {}
        self._done: set[str] = set(done)
        """Groups handed out, or trained or dropped before a restart (`done`): their later events are
        resends or a re-run's, never handed out again and holding nothing back."""
        self.repeated = 0
        """`GroupCompleted` events of groups in `_done` (a re-run, or a resend after a broker lost its log)."""

    def add(self, event, partition: Partition = ("", 0), offset: int = 0) -> TrainGroup | None:
        self._next[partition] = max(self._next.get(partition, 0), offset + 1)
        group_id = getattr(event, "group_id", None)
        if event.run_id != self.run_id or group_id is None:
            return None
        if group_id in self._done:
            self.repeated += isinstance(event, GroupCompleted)
            return None
        pending = self._pending.setdefault(group_id, _Pending())
        pending.first_offsets.setdefault(partition, offset)
        if isinstance(event, StepRecorded):
            pending.steps[event.trajectory_id].setdefault(event.step, event)
        elif isinstance(event, GroupCompleted):
            pending.completed = event  # a re-run's announcement replaces an earlier one still waiting
        if not pending.whole():
            return None
        return self._hand_out(self._pending.pop(group_id))

    def knows(self, group_id: str) -> bool:
        """The group was handed out (or trained or dropped before a restart), or is announced and waits."""
        pending = self._pending.get(group_id)
        return group_id in self._done or (pending is not None and pending.completed is not None)

    def waiting(self) -> list[GroupCompleted]:
        """Groups announced complete that still wait for a step (a resend the announcement overtook)."""
        return [p.completed for p in self._pending.values() if p.completed is not None]

    def abandon(self, group_id: str) -> TrainGroup:
        """Stop waiting for a group's steps: the group as far as it came, held until `release`d (to drop it)."""
        return self._hand_out(self._pending.pop(group_id))

    def _hand_out(self, pending: _Pending) -> TrainGroup:
        event = pending.completed
        self._done.add(event.group_id)
        self._held[event.group_id] = pending.first_offsets
        trajectories = [sorted(pending.steps.get(t, {}).values(), key=lambda s: s.step) for t in event.trajectory_ids]
        advantages = group_advantages(control_rewards(event, self.control), scale_by_std=self.scale_by_std)
        return TrainGroup(event, trajectories, advantages, pending.first_offsets)

    def release(self, group_id: str) -> None:
        """The group was trained (and published) or dropped: its events may be committed."""
        self._held.pop(group_id, None)

    def committable(self) -> dict[Partition, int]:
        """Per partition, the offset before which every event is fully processed."""
        out = dict(self._next)
        for offsets in [p.first_offsets for p in self._pending.values()] + list(self._held.values()):
            for tp, o in offsets.items():
                out[tp] = min(out.get(tp, o), o)
        return out


@dataclass
class BuilderStats:
    groups_trained: int = 0
    dropped: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    wait_s: float = 0.0


class BatchBuilder:
    """Kafka consumer of one run's rollout events; `next_batch` blocks until a full batch is admissible."""

    def __init__(self, settings: StackSettings, config: TrainConfig, producer: EventProducer, skip: Iterable[str] = ()):
        self.config, self.producer = config, producer
        self.consumer = EventConsumer(settings, config.group_id, [ROLLOUT], producer, client_id="trainer")
        self.store = ScreenshotStore.from_settings(settings)
        self.assembler = GroupAssembler(config.run_id, config.control, config.grpo.scale_by_std, done=skip)
        self.settings = settings
        self.ready: list[TrainGroup] = []
        self.stats = BuilderStats()
        self.starvation = Starvation()
        self._replacements: int | None = None
        """The consumer's count of brokers found replaced when the ledger was last read (None: never)."""
        self._read_again_at = float("inf")
        """When to read the ledger once more after a replacement: the writers may still have been
        writing what they had read from the lost log."""

    def next_batch(self, version: int) -> list[TrainGroup] | None:
        """`groups_per_update` admissible groups, or None after `batch_timeout_s` without one."""
        t0 = said = time.monotonic()
        n = self.config.groups_per_update
        while True:
            if self._replacements != self.consumer.broker_replacements or time.monotonic() > self._read_again_at:
                self._read_ledger(version)
            self._drop_stale(version)
            if time.monotonic() - said > WAITING_LOG_S:
                said = time.monotonic()
                log.info("waiting %.0fs for a batch at v%d: %s", said - t0, version, self.describe())
                self._read_ledger(version)  # a group confirmed by the ledger just before the log went
            if len(self.ready) >= n:
                batch, self.ready = self.ready[:n], self.ready[n:]
                self.stats.wait_s += time.monotonic() - t0
                return batch
            timeout = self.config.batch_timeout_s
            if timeout is not None and time.monotonic() - t0 > timeout:
                return None
            for d in self.consumer.poll(timeout_ms=500):
                self._accept(d, version)

    def _read_ledger(self, version: int) -> None:
        """Fold in the groups of the run the ledger has and this builder never saw: on start and after
        the broker was found replaced (its log lost, with events the outboxes will not send again),
        and while it waits. Groups also on their way in the log count once (by group id and step)."""
        replaced = self._replacements not in (None, self.consumer.broker_replacements)
        self._replacements = self.consumer.broker_replacements
        self._read_again_at = time.monotonic() + LEDGER_AGAIN_S if replaced else float("inf")
        try:
            events = ledger_groups(self.settings, self.config.run_id, self.assembler.knows)
        except Exception as exc:  # noqa: BLE001 - a store outage: read it again at the next wait
            log.warning("reading the ledger for groups the log lost: %s", exc)
            return
        for offset, event in enumerate(events):
            self._accept(Delivered(event, *LEDGER, offset), version)
        if events:
            log.info("read %d events of groups not seen in the log from the ledger", len(events))

    def _accept(self, d: Delivered, version: int) -> None:
        group = self.assembler.add(d.event, (d.topic, d.partition), d.offset)
        if group is None:
            return
        if "judge_error" in group.completed.outcomes:  # no verdict is not a failure: never trained on
            self._drop(group, "judge_error", version)
        elif not group.has_tokens:
            self._drop(group, "no_tokens", version)
        elif not self._informative(group):
            self._drop(group, "uninformative", version)
        elif damage := self._damaged_screenshot(group):
            self._drop(group, damage, version)
        else:
            self.ready.append(group)

    def _damaged_screenshot(self, group: TrainGroup) -> str | None:
        """The drop reason if a screenshot of the group cannot be trusted, else None.

        Checked here, once per group and before it can enter a batch, so a damaged object drops one
        group instead of crashing the update (every rank's fetch verifies too, so bytes that go bad
        later still never reach the model). The bytes are not kept: ranks fetch their own shards, and
        holding a batch's pixels on the leader would cost memory for a fraction of the fetches.
        Store outages are not damage: they propagate, and a restarted trainer re-reads the group."""
        try:
            self.store.get_many(group.screenshot_hashes())
        except ScreenshotCorrupted as exc:
            return self._damage("screenshot_corrupted", group, exc)
        except ScreenshotMissing as exc:
            return self._damage("screenshot_missing", group, exc)
        return None

    def _damage(self, reason: str, group: TrainGroup, exc: Exception) -> str:
        # GroupDropped has no free-text field: the operator's log carries which object failed
        log.warning("dropping group %s (%s): %s", group.group_id, reason, exc)
        return reason

    def _informative(self, group: TrainGroup) -> bool:
        rewards = group.completed.rewards
        if self.config.loss == "raft":
            return max(rewards) > 0
        return informative(rewards) or not self.config.dynamic_sampling

    def _drop_stale(self, version: int) -> None:
        keep = []
        for g in self.ready:
            if admissible(g.behaviour_versions(), version, self.config.eta):
                keep.append(g)
            else:
                self._drop(g, "stale", version)
        self.ready = keep
        # A group waiting for an overtaken step waits as long as it could still be trained.
        for completed in self.assembler.waiting():
            if not admissible([completed.min_policy_version], version, self.config.eta):
                self._drop(self.assembler.abandon(completed.group_id), "steps_missing", version)

    def _drop(self, group: TrainGroup, reason: str, version: int) -> None:
        steps = [s for t in group.trajectories for s in t]
        rewards = group.completed.rewards
        event = GroupDropped(
            run_id=self.config.run_id,
            group_id=group.group_id,
            task_id=group.completed.task_id,
            reason=reason,
            trainer_version=version,
            min_policy_version=min(group.behaviour_versions(), default=0),
            mean_reward=sum(rewards) / max(len(rewards), 1),
            invalid_share=sum(s.error_class == "invalid_action" for s in steps) / max(len(steps), 1),
        )
        self.producer.publish(event)
        self.stats.dropped[reason] += 1
        self.starvation.add(event)
        if self.starvation.groups and self.starvation.groups % STARVING_LOG_EVERY == 0:
            log.warning("%s", self.starvation.message())
        self.assembler.release(group.group_id)

    def describe(self) -> str:
        s = self.stats
        return (
            f"{len(self.ready)} groups ready, {s.groups_trained} trained, dropped {dict(s.dropped)}, "
            f"{self.assembler.repeated} seen before, {len(self.assembler.waiting())} waiting for a step, "
            f"{len(self.consumer.assignment())} partitions assigned, positions {self.consumer.polled()}"
        )

    def trained(self, batch: list[TrainGroup]) -> None:
        """The batch's update is published: its groups no longer hold back the commit."""
        for g in batch:
            self.assembler.release(g.group_id)
        self.stats.groups_trained += len(batch)
        self.starvation.reset()

    def commit(self) -> None:
        """Commit consumed positions (after the drops are acknowledged, so none is lost)."""
        self.producer.flush(timeout=60)
        self.consumer.commit({p: o for p, o in self.assembler.committable().items() if p != LEDGER})

    def close(self) -> None:
        self.consumer.close()
