"""The curriculum: task families drawn by their recent success, seeded from the ledger and fed by the log."""

from __future__ import annotations

import uuid
from collections import Counter

from pipeline.bus import EventProducer, read_log
from pipeline.ledger import LedgerWriter
from pipeline.topics import TASKS
from rollout.curriculum import Curriculum, CurriculumConfig, family_index, seed_from_ledger
from rollout.run import RolloutRequest, run_rollout
from rollout.suites.boxes import BoxesSuite, make_task
from schemas import EpisodeFinished, GroupCompleted, TaskGroupDispatched

TASKS_ = [make_task(template, seed, "train") for template in ("red", "any", "colour") for seed in range(5)]


def _draw(curriculum: Curriculum, n: int) -> Counter:
    return Counter(next(curriculum).template for _ in range(n))


def test_unmeasured_families_are_in_band_and_drawn_evenly():
    counts = _draw(Curriculum(TASKS_, CurriculumConfig(explore=0.0), seed=1), 300)
    assert set(counts) == {"red", "any", "colour"} and min(counts.values()) > 70


def test_mastered_and_hopeless_families_are_drawn_only_to_explore():
    curriculum = Curriculum(TASKS_, CurriculumConfig(explore=0.1, window=8, min_episodes=4), seed=2)
    curriculum.record("boxes-any-0", [1.0] * 8)  # mastered
    curriculum.record("boxes-colour-1", [0.0] * 8)  # hopeless
    curriculum.record("boxes-red-2", [1.0, 0.0, 0.0, 1.0])  # 0.5: in band
    state = {s.family: s for s in curriculum.state()}
    assert (state["any"].success, state["any"].in_band) == (1.0, False)
    assert (state["colour"].success, state["colour"].in_band) == (0.0, False)
    assert (state["red"].success, state["red"].in_band) == (0.5, True)
    counts = _draw(curriculum, 1000)
    assert counts["red"] > 900 and 10 < counts["any"] < 70 and 10 < counts["colour"] < 70
    assert curriculum.drawn_outside_band == counts["any"] + counts["colour"]


def test_the_window_forgets_old_outcomes_and_no_band_falls_back_to_all():
    curriculum = Curriculum(TASKS_, CurriculumConfig(explore=0.0, window=4, min_episodes=4), seed=3)
    for task_id in ("boxes-any-0", "boxes-colour-0", "boxes-red-0"):
        curriculum.record(task_id, [0.0] * 4)
    assert not any(s.in_band for s in curriculum.state())
    assert set(_draw(curriculum, 60)) == {"red", "any", "colour"}  # nothing in band: every family
    curriculum.on_event(GroupCompleted(run_id="r", group_id="g", task_id="boxes-red-3", trajectory_ids=["a", "b"],
                                       rewards=[1.0, 1.0], num_steps=[1, 1], outcomes=["success"] * 2,
                                       min_policy_version=0, max_policy_version=0))
    assert {s.family: s.success for s in curriculum.state()}["red"] == 0.5  # two old failures fell out
    assert set(_draw(curriculum, 60)) == {"red"}


def test_outcomes_of_unseen_seeds_count_for_their_template_and_unknown_ids_are_ignored():
    suite = BoxesSuite()
    curriculum = Curriculum(TASKS_, CurriculumConfig(min_episodes=1), family_of=family_index(suite))
    test_task = suite.tasks("test")[0]
    curriculum.record(test_task.task_id, [1.0])
    curriculum.record("miniwob-click-button-3", [1.0])
    assert {s.family: s.episodes for s in curriculum.state()} == {"any": 0, "colour": 0, "red": 0} | {
        test_task.template: 1}


def test_a_run_is_seeded_from_the_ledger_and_dispatches_in_band_families_only(settings):
    """An earlier run's ledgered outcomes say `any` is mastered and `red` half-solved: the run
    dispatches red only (no exploration); its dispatched groups on the real broker show it."""
    prior = f"prior-{uuid.uuid4().hex[:6]}"
    producer = EventProducer(settings)
    producer.publish_all([
        EpisodeFinished(run_id=prior, trajectory_id=f"t{i}", group_id=f"g{i}", task_id=task_id, num_steps=1,
                        outcome="success" if reward else "failure", reward=reward, reason="judged")
        for i, (task_id, reward) in enumerate([("boxes-any-1", 1.0)] * 8 + [("boxes-red-1", 1.0), ("boxes-red-2", 0.0)] * 4)
    ])
    producer.close()
    LedgerWriter(settings).sync(idle_exit_s=2.0)
    probe = Curriculum(TASKS_, CurriculumConfig())
    assert seed_from_ledger(probe, settings, [prior]) == 16
    assert {s.family: s.success for s in probe.state()} == {"any": 1.0, "colour": None, "red": 0.5}

    run_id = f"curr-{uuid.uuid4().hex[:6]}"
    stats = run_rollout(settings, RolloutRequest(
        suite="boxes", policy="oracle", workers=2, group_size=2, episodes=8, templates=("red", "any"),
        run_id=run_id, curriculum=CurriculumConfig(explore=0.0), curriculum_from=(prior,)), show_progress=False)
    assert stats.episodes == 8
    dispatched = [e for e in read_log(settings, TASKS) if isinstance(e, TaskGroupDispatched) and e.run_id == run_id]
    assert len(dispatched) == 4 and {e.task_id.split("-")[1] for e in dispatched} == {"red"}
