"""Resends can overtake: steps a broker acknowledged and then lost are resent by their producer's outbox
seconds later, while a `GroupCompleted` sent after the restart goes straight to the new broker and
arrives first. The trainer's group assembly (`trainer.batch`) must never hand out a group with a
missing step, must hand it out whole once the step comes, and must drop it (`steps_missing`) rather
than hold it open once it could no longer be trained. The negative control runs the same sequence with
the assembly's one new rule (wait for every step the announcement names) taken out."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

import pytest

from pipeline.bus import EventProducer
from pipeline.hashing import sha256_hex
from pipeline.store import ScreenshotStore
from schemas import GroupDropped, StepRecorded
from trainer.batch import BatchBuilder, GroupAssembler, _Pending
from trainer.config import TrainConfig

from samples import render_page, sample_group
from test_train_resume import trainer_events

SHA = "ab" * 32
POLLS = 40
"""Batch timeouts the broker test waits at most for what it published (budgeted in calls, not seconds)."""


def overtaken(run_id: str, group_id: str, sha: str = SHA, seed: int = 2) -> tuple[list, StepRecorded]:
    """A group's events as the trainer receives them when one step was lost with a broker: the
    announcement, and everything else, before the resent step (returned apart, to deliver later)."""
    events = list(sample_group(run_id, group_id, [sha], group_size=3, steps=4, seed=seed))
    late = [e for e in events if isinstance(e, StepRecorded)][1]
    return [e for e in events if e is not late], late


def feed(asm: GroupAssembler, events: list, first: int = 0) -> list:
    """Deliver `events` on one partition from offset `first`; the groups handed out."""
    return [g for i, e in enumerate(events) if (g := asm.add(e, ("rollout", 0), first + i)) is not None]


def test_a_group_announced_before_a_resent_step_waits_for_it_and_is_handed_out_whole():
    asm = GroupAssembler("run")
    early, late = overtaken("run", "g0")
    assert feed(asm, early) == []  # announced, but a step is missing: nothing to train yet
    assert [c.group_id for c in asm.waiting()] == ["g0"]
    assert asm.committable() == {("rollout", 0): 0}  # and its events stay uncommitted
    (group,) = feed(asm, [late], first=len(early))
    assert [[s.step for s in t] for t in group.trajectories] == [list(range(n)) for n in group.completed.num_steps]
    assert asm.waiting() == []
    asm.release("g0")
    assert asm.committable() == {("rollout", 0): len(early) + 1}


def test_negative_control_without_waiting_the_group_is_handed_out_with_its_step_missing(monkeypatch):
    """The assembly before the fix: `GroupCompleted` alone made a group whole (every step was assumed
    to have come first, as the partition key orders them)."""
    monkeypatch.setattr(_Pending, "whole", lambda self: self.completed is not None)
    asm = GroupAssembler("run")
    early, late = overtaken("run", "g0")
    (group,) = feed(asm, early)
    assert sum(map(len, group.trajectories)) == sum(group.completed.num_steps) - 1  # trained short


def test_a_step_resent_while_the_trainer_had_it_counts_once():
    asm = GroupAssembler("run")
    events = list(sample_group("run", "g0", [SHA], group_size=2, steps=3, seed=4))
    again = [e for e in events if isinstance(e, StepRecorded)][:2]  # a needless resend, same event ids
    (group,) = feed(asm, events[:-1] + again + events[-1:])
    assert [len(t) for t in group.trajectories] == group.completed.num_steps


def test_events_of_a_group_already_handed_out_hold_nothing_back():
    """After a broker lost its log, the outbox resends a trained group's steps and announcement: they
    are not handed out again and, unlike a pending group's, do not hold back the commit."""
    asm = GroupAssembler("run", done=["trained-before-restart"])
    events = list(sample_group("run", "g0", [SHA], group_size=2, steps=3, seed=5))
    assert len(feed(asm, events)) == 1
    asm.release("g0")
    before = list(sample_group("run", "trained-before-restart", [SHA], group_size=2, steps=2, seed=6))
    assert feed(asm, events + before, first=len(events)) == []
    assert asm.repeated == 2
    assert asm.committable() == {("rollout", 0): 2 * len(events) + len(before)}


@pytest.mark.timeout(600)
def test_the_batch_builder_waits_for_an_overtaken_step_then_drops_a_group_whose_step_never_comes(settings):
    """Through the real broker: g0's announcement is in the log before one of its steps, g1's step never
    comes. g0 is trained whole once its step arrives; g1 is dropped as `steps_missing` once the
    trainer's version leaves its staleness bound, not before."""
    run_id = f"overtaken-{uuid.uuid4().hex[:6]}"
    store = ScreenshotStore.from_settings(settings)
    store.ensure_bucket()
    png = render_page(run_id, size=(320, 240))
    store.put(png)
    g0, g0_late = overtaken(run_id, "g0", sha256_hex(png), seed=7)
    g1, _ = overtaken(run_id, "g1", sha256_hex(png), seed=8)
    producer = EventProducer(settings)
    producer.publish_all(g0 + g1)
    config = TrainConfig(run_id=run_id, groups_per_update=1, dynamic_sampling=False, batch_timeout_s=5, eta=2)
    builder = BatchBuilder(settings, config, producer)
    try:
        for _ in range(POLLS):  # a batch timeout is seconds: a loaded machine may need several to join
            assert builder.next_batch(0) is None  # both announced, neither whole
            if len(builder.assembler.waiting()) == 2:
                break
        assert sorted(c.group_id for c in builder.assembler.waiting()) == ["g0", "g1"]
        producer.publish(g0_late)
        for _ in range(POLLS):
            if batch := builder.next_batch(0):
                break
        (group,) = batch
        assert group.group_id == "g0"
        assert [len(t) for t in group.trajectories] == group.completed.num_steps
        builder.trained([group])
        assert builder.next_batch(config.eta) is None  # g1 could still be trained: it waits
        assert dict(builder.stats.dropped) == {}
        assert builder.next_batch(config.eta + 1) is None
        assert dict(builder.stats.dropped) == {"steps_missing": 1}
        builder.commit()
    finally:
        builder.close()
        producer.close()
    drops = [e for e in trainer_events(settings, run_id) if isinstance(e, GroupDropped)]
    assert [(d.group_id, d.reason) for d in drops] == [("g1", "steps_missing")]


def test_the_soak_reconciliation_finds_a_group_trained_with_a_step_missing():
    """`bench/chaos_reconcile.py`, planted: an update that scored one step's tokens fewer than the ledger
    holds for its trajectories, and a group whose step is not in the ledger, are both found."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from chaos_reconcile import _trained_short

    events = list(sample_group("run", "g0", [SHA], group_size=2, steps=3, seed=9))
    completed = {"g0": events[-1].model_dump()}
    steps: dict[str, dict[int, dict]] = {}
    for s in (e for e in events if isinstance(e, StepRecorded)):
        steps.setdefault(s.trajectory_id, {})[s.step] = {"response_token_ids": list(s.response_token_ids)}
    tokens = sum(len(s["response_token_ids"]) for t in steps.values() for s in t.values())
    update = {"group_ids": ["g0"], "trajectory_ids": completed["g0"]["trajectory_ids"]}
    assert _trained_short([{**update, "stats": [("tokens", float(tokens))]}], completed, steps) == set()
    short = tokens - len(steps["g0-t0"][0]["response_token_ids"])
    assert _trained_short([{**update, "stats": [("tokens", float(short))]}], completed, steps) == {"g0"}
    del steps["g0-t1"][0]  # the ledger itself lacks a step of a trained group (its tokens all scored)
    assert _trained_short([{**update, "stats": [("tokens", float(tokens))]}], completed, steps) == {"g0"}
