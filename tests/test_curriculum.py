"""The curriculum: task families drawn by their recent success, seeded from the ledger and fed by the log."""

from __future__ import annotations

import uuid
from collections import Counter
from datetime import UTC, datetime, timedelta

import pyarrow.parquet as pq

from analysis.informative import InformativeGroups, informative_groups
from analysis.views import connect
from pipeline.bus import EventProducer
from pipeline.consumer import read_log
from pipeline.ledger import LedgerWriter
from pipeline.topics import TASKS
from rollout.curriculum import Curriculum, CurriculumConfig, family_index, seed_from_ledger
from rollout.run import RolloutRequest, run_rollout
from rollout.suites.boxes import BoxesSuite, make_task
from schemas import EpisodeFinished, GroupCompleted, TaskGroupDispatched, events_to_table

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
    curriculum.on_event(
        GroupCompleted(
            run_id="r",
            group_id="g",
            task_id="boxes-red-3",
            trajectory_ids=["a", "b"],
            rewards=[1.0, 1.0],
            num_steps=[1, 1],
            outcomes=["success"] * 2,
            min_policy_version=0,
            max_policy_version=0,
        )
    )
    assert {s.family: s.success for s in curriculum.state()}["red"] == 0.5  # two old failures fell out
    assert set(_draw(curriculum, 60)) == {"red"}


def test_outcomes_of_unseen_seeds_count_for_their_template_and_unknown_ids_are_ignored():
    suite = BoxesSuite()
    curriculum = Curriculum(TASKS_, CurriculumConfig(min_episodes=1), family_of=family_index(suite))
    test_task = suite.tasks("test")[0]
    curriculum.record(test_task.task_id, [1.0])
    curriculum.record("miniwob-click-button-3", [1.0])
    assert {s.family: s.episodes for s in curriculum.state()} == {"any": 0, "colour": 0, "red": 0} | {
        test_task.template: 1
    }


def _ids(curriculum: Curriculum, n: int) -> list[str]:
    return [next(curriculum).task_id for _ in range(n)]


def _group(task_id: str, rewards: list[float]) -> GroupCompleted:
    return GroupCompleted(
        run_id="r",
        group_id=uuid.uuid4().hex,
        task_id=task_id,
        trajectory_ids=[f"t{i}" for i in range(len(rewards))],
        rewards=rewards,
        num_steps=[1] * len(rewards),
        outcomes=["success" if r else "failure" for r in rewards],
        min_policy_version=0,
        max_policy_version=0,
    )


def test_instances_whose_last_groups_were_all_equal_are_skipped():
    curriculum = Curriculum(TASKS_, CurriculumConfig(explore=0.0, skip_uninformative=2, skip_passes=1000), seed=4)
    for rewards in ([1.0, 1.0], [1.0, 1.0]):  # mastered: two all-success groups
        curriculum.on_event(_group("boxes-red-0", rewards))
    for rewards in ([0.0, 0.0], [0.0, 0.0]):  # hopeless
        curriculum.record_group("boxes-red-1", rewards)
    for rewards in ([0.0, 0.0], [1.0, 0.0]):  # the last group was informative: kept
        curriculum.record_group("boxes-red-2", rewards)
    curriculum.record_group("boxes-red-3", [0.0, 0.0])  # one all-equal group is not yet N = 2
    for rewards in ([1.0, 0.0], [1.0, 1.0], [0.0, 0.0]):  # informative, then two all-equal: the last N count
        curriculum.record_group("boxes-any-4", rewards)
    curriculum.record_group("boxes-red-99", [0.0, 0.0])  # not an instance it dispatches: ignored
    assert {s.family: s.skipped for s in curriculum.state()} == {"any": 1, "colour": 0, "red": 2}
    drawn = Counter(_ids(curriculum, 600))
    assert {"boxes-red-0", "boxes-red-1", "boxes-any-4"}.isdisjoint(drawn)
    assert {"boxes-red-2", "boxes-red-3", "boxes-red-4", "boxes-any-0"} <= set(drawn)
    assert len(drawn) == 15 - 3 and curriculum.passed_over > 0 and curriculum.skips_ignored == 0
    # the families keep their shares: red's three open instances take red's third
    assert 150 < sum(n for t, n in drawn.items() if "-red-" in t) < 250
    curriculum.record_group("boxes-red-1", [1.0, 0.0])  # informative again: no longer skipped
    assert "boxes-red-1" in _ids(curriculum, 100)


def test_a_skip_runs_out_after_its_passes_and_an_all_equal_retry_skips_again():
    red = [t for t in TASKS_ if t.template == "red"]  # 5 instances; skip_passes = 1: 5 draws
    curriculum = Curriculum(red, CurriculumConfig(skip_uninformative=2, skip_passes=1), seed=5)
    curriculum.record_group("boxes-red-0", [0.0, 0.0])
    curriculum.record_group("boxes-red-0", [0.0, 0.0])
    assert "boxes-red-0" not in _ids(curriculum, 5)
    assert "boxes-red-0" in _ids(curriculum, 10)  # its skip ran out: retried
    curriculum.record_group("boxes-red-0", [1.0, 1.0])  # the retry is all-equal too: skipped again
    assert "boxes-red-0" not in _ids(curriculum, 5)


def test_a_closed_family_comes_back_and_all_skipped_falls_back_to_every_instance():
    red_any = [t for t in TASKS_ if t.template in ("red", "any")]
    # low = 0: red's failures keep it in band, so only its skips keep it out
    curriculum = Curriculum(
        red_any, CurriculumConfig(low=0.0, explore=0.0, skip_uninformative=1, skip_passes=2), seed=6
    )
    for seed in range(5):
        curriculum.record_group(f"boxes-red-{seed}", [0.0, 0.0])
    # every red instance skipped: red is not drawn; its clock moves 1 a draw (one open family), so its
    # skips (2 passes x 5 instances) run out after 10 draws
    assert {t.split("-")[1] for t in _ids(curriculum, 10)} == {"any"}
    assert "red" in {t.split("-")[1] for t in _ids(curriculum, 40)}

    curriculum = Curriculum(red_any, CurriculumConfig(explore=0.0, skip_uninformative=1, skip_passes=1000), seed=6)
    for task in red_any:
        curriculum.record_group(task.task_id, [1.0, 1.0])
    drawn = _ids(curriculum, 200)  # every instance skipped: never starve, draw from all
    assert set(drawn) == {t.task_id for t in red_any} and curriculum.skips_ignored == 200


def test_instance_skips_are_deterministic_under_the_seed_and_off_by_default():
    def run(seed: int, config: CurriculumConfig) -> list[str]:
        curriculum, drawn = Curriculum(TASKS_, config, seed=seed), []
        for _ in range(60):
            task_id = next(curriculum).task_id
            drawn.append(task_id)
            # a hand-made policy: seeds 0-1 always fail, 2 always succeeds, 3-4 are mixed
            seed_ = int(task_id.rsplit("-", 1)[1])
            curriculum.record_group(task_id, [0.0, 0.0] if seed_ < 2 else [1.0, 1.0] if seed_ == 2 else [1.0, 0.0])
        return drawn

    on = CurriculumConfig(skip_uninformative=1, skip_passes=1000)
    assert run(7, on) == run(7, on) and run(7, on) != run(8, on)
    late = run(7, on)[30:]
    assert sum(int(t.rsplit("-", 1)[1]) >= 3 for t in late) == len(late)  # only the mixed seeds remain
    off = run(7, CurriculumConfig())  # the default: no skips, the draws of the family curriculum alone
    assert off == run(7, CurriculumConfig(skip_uninformative=0))
    assert sum(int(t.rsplit("-", 1)[1]) < 3 for t in off[30:]) > 5


def test_the_ledger_gives_the_share_of_informative_groups_and_their_rate(tmp_path):
    """One dispatch at t0, four groups completed by t0 + 2 min, one with unequal rewards: a share of
    1/4 and 1 / 2 min = 0.5 informative groups a minute. Another run's group is not counted."""
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    events = [
        TaskGroupDispatched(
            run_id="r",
            group_id="g0",
            task_id="boxes-red-0",
            suite="boxes",
            seed=0,
            group_size=2,
            horizon=1,
            dispatched_at_version=0,
            emitted_at=t0,
        )
    ]
    for i, rewards in enumerate([[1.0, 1.0], [0.0, 0.0], [1.0, 0.0], [0.0, 0.0]]):
        events.append(
            _group("boxes-red-0", rewards).model_copy(update={"emitted_at": t0 + timedelta(seconds=30 * (i + 1))})
        )
    events.append(_group("boxes-red-1", [1.0, 0.0]).model_copy(update={"run_id": "other"}))
    for (run, kind), batch in _by(events, lambda e: (e.run_id, type(e).__name__)).items():
        directory = tmp_path / f"run_id={run}" / f"event_type={kind}"
        directory.mkdir(parents=True)
        pq.write_table(events_to_table(batch), directory / "part-0.parquet")
    con = connect(tmp_path)
    assert informative_groups(con, "r") == InformativeGroups(
        groups=4, informative=1, share=0.25, minutes=2.0, per_minute=0.5
    )
    assert informative_groups(con, "nobody") == InformativeGroups(0, 0, None, None, None)


def _by(events, key) -> dict:
    out: dict = {}
    for e in events:
        out.setdefault(key(e), []).append(e)
    return out


def test_a_run_is_seeded_from_the_ledger_and_dispatches_in_band_families_only(settings):
    """An earlier run's ledgered outcomes say `any` is mastered and `red` half-solved: the run
    dispatches red only (no exploration); its dispatched groups on the real broker show it."""
    prior = f"prior-{uuid.uuid4().hex[:6]}"
    producer = EventProducer(settings)
    producer.publish_all(
        [
            EpisodeFinished(
                run_id=prior,
                trajectory_id=f"t{i}",
                group_id=f"g{i}",
                task_id=task_id,
                num_steps=1,
                outcome="success" if reward else "failure",
                reward=reward,
                reason="judged",
            )
            for i, (task_id, reward) in enumerate(
                [("boxes-any-1", 1.0)] * 8 + [("boxes-red-1", 1.0), ("boxes-red-2", 0.0)] * 4
            )
        ]
    )
    producer.close()
    LedgerWriter(settings).sync(idle_exit_s=2.0)
    probe = Curriculum(TASKS_, CurriculumConfig())
    assert seed_from_ledger(probe, settings, [prior]) == 16
    assert {s.family: s.success for s in probe.state()} == {"any": 1.0, "colour": None, "red": 0.5}

    run_id = f"curr-{uuid.uuid4().hex[:6]}"
    stats = run_rollout(
        settings,
        RolloutRequest(
            suite="boxes",
            policy="oracle",
            workers=2,
            group_size=2,
            episodes=8,
            templates=("red", "any"),
            run_id=run_id,
            curriculum=CurriculumConfig(explore=0.0),
            curriculum_from=(prior,),
        ),
        show_progress=False,
    )
    assert stats.episodes == 8
    dispatched = [e for e in read_log(settings, TASKS) if isinstance(e, TaskGroupDispatched) and e.run_id == run_id]
    assert len(dispatched) == 4 and {e.task_id.split("-")[1] for e in dispatched} == {"red"}
