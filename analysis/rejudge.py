"""Judge a recorded run again, offline, with another judge (`awrl rejudge`).

Each finished trajectory of the run (not the environment's failures) is rebuilt from the ledger as
the judge would have seen it live: the instruction (`EpisodeStarted`), one history line per step
(`StepRecorded`: the response's thought, the recorded action, the page's feedback; the same line as
`rollout.judges.history_line` writes live), the final answer (`EpisodeFinished`) and the last K
screenshots from the store by their hashes. The new verdicts are `TrajectoryJudged` events of the
same run that give no reward, beside the old ones, so `awrl_judge_agreement` and
`awrl_reward_hacking` compare them with the rule's (or any judge's) at once.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import duckdb

from rollout.actions import describe, parse_response
from rollout.judges import JudgeInput, ModelJudge, history_line, judged_event
from schemas import Action


@dataclass(frozen=True)
class Recorded:
    """One trajectory as a judge sees it, with the ids its verdict is recorded under."""

    ids: dict
    instruction: str
    answer: str | None
    history: list[str]
    screenshot_sha256: list[str]


@dataclass
class RejudgeSummary:
    run_id: str
    trajectories: int = 0
    successes: int = 0
    judge_errors: int = 0
    seconds: float = 0.0


def recorded_trajectories(con: duckdb.DuckDBPyConnection, run_id: str) -> Iterator[Recorded]:
    """The run's finished trajectories (success or failure), in the order they started."""
    started = con.execute(
        "SELECT s.trajectory_id, s.group_id, s.task_id, s.instruction, f.answer FROM episode_started s "
        "JOIN episode_finished f USING (run_id, trajectory_id) "
        "WHERE s.run_id = ? AND f.outcome IN ('success', 'failure') ORDER BY s.emitted_at, s.trajectory_id",
        [run_id],
    ).fetchall()
    steps = defaultdict(list)
    for tid, step, text, action, feedback, sha in con.execute(
        "SELECT trajectory_id, step, response_text, action, env_feedback, screenshot_sha256 FROM step_recorded "
        "WHERE run_id = ? ORDER BY trajectory_id, step",
        [run_id],
    ).fetchall():
        thought = parse_response(text, {}, frozenset()).thought
        line = history_line(step, thought, describe(Action.model_validate(_present(action))), feedback)
        steps[tid].append((line, sha))
    for tid, group_id, task_id, instruction, answer in started:
        ids = dict(run_id=run_id, trajectory_id=tid, group_id=group_id, task_id=task_id)
        lines = steps.get(tid, [])
        yield Recorded(ids, instruction, answer, [line for line, _ in lines], [sha for _, sha in lines])


def _present(action: dict) -> dict:
    """The recorded action's fields that are set (the Parquet struct holds every field, mostly null)."""
    return {k: v for k, v in action.items() if v is not None}


async def rejudge(
    trajectories: list[Recorded],
    judge: ModelJudge,
    screenshots: Callable[[list[str]], list[bytes]],
    emit: Callable,
    concurrency: int = 4,
    progress: Callable[[int], None] = lambda n: None,
    name: str = "rejudged",
) -> RejudgeSummary:
    """Judge each trajectory (`concurrency` at a time) and `emit` its verdict as a `TrajectoryJudged`
    named `name` that gives no reward. `screenshots(hashes)` returns the images of the given hashes, in
    order."""
    summary = RejudgeSummary(trajectories[0].ids["run_id"] if trajectories else "")
    gate = asyncio.Semaphore(concurrency)
    k = judge.config.screenshots

    async def one(t: Recorded) -> None:
        async with gate:
            shots = await asyncio.to_thread(screenshots, t.screenshot_sha256[-k:] if k else [])
            judged = await judge.judge(JudgeInput(t.instruction, t.answer, t.history, shots))
        emit(judged_event(t.ids, name, judged, gives_reward=False, judge=judge))
        summary.trajectories += 1
        summary.successes += judged.success is True
        summary.judge_errors += judged.success is None
        progress(summary.trajectories)

    await asyncio.gather(*(one(t) for t in trajectories))
    return summary
