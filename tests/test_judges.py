"""The model judge (`rollout.judges`): parsing, retries and refusals against a real HTTP server, an
episode whose reward comes from it with the rule's verdict beside it, the `judge_error` path through
the broker to the trainer's drop, and the agreement and reward-hacking queries over what was recorded.
The judge server is `judge_server.JudgeServer`: an OpenAI-compatible endpoint whose answers follow a
rule, so that every count here is exact."""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest
from judge_server import JudgeServer

from rollout.judges import JudgeInput, ModelJudge, ModelJudgeConfig, UnparseableVerdict, parse_verdict
from rollout.suites.boxes.suite import BoxesSuite, make_task
from schemas import EpisodeFinished, TrajectoryJudged

from samples import render_page

PNG = render_page("judge", size=(160, 120))


def test_a_verdict_is_read_from_json_in_prose_or_fences():
    assert parse_verdict('{"success": true, "reason": "done"}') == (True, "done")
    assert parse_verdict('Sure.\n```json\n{"success": false, "reason": "wrong box"}\n```') == (False, "wrong box")
    assert parse_verdict('{"note": 1} then {"success": true}') == (True, "")  # the first object with a verdict
    for text in ('{"success": "yes", "reason": "r"}', "the agent did fine", '{"success": tru'):
        with pytest.raises(UnparseableVerdict):
            parse_verdict(text)


def _input(mark: int, instruction: str = "Click the red box.") -> JudgeInput:
    line = f"1. click the box | click(mark={mark}) | clicked button 'box'"
    return JudgeInput(instruction, None, [line], [PNG, PNG, PNG, PNG])


def _judge(url: str, **kw) -> ModelJudge:
    return ModelJudge(ModelJudgeConfig(url=url, model="judge-test", **kw))


def test_the_model_judge_asks_with_the_inputs_and_reads_the_answer():
    with JudgeServer("rule") as server:
        judge = _judge(server.url, screenshots=2)
        right, wrong = (asyncio.run(judge.judge(_input(m))) for m in (0, 1))  # red is mark 0
    assert (right.success, wrong.success) == (True, False) and right.error is None
    assert right.attempts == 1 and right.prompt_tokens > 0 and right.completion_tokens > 0
    assert "clicked the red box" in right.reason and '"success": true' in right.response_text
    body = judge.request_body(_input(0))
    parts = body["messages"][0]["content"]
    assert [p["type"] for p in parts] == ["text", "image_url", "image_url"]  # K = 2 of 4 screenshots
    assert "Click the red box." in parts[0]["text"] and "click(mark=0)" in parts[0]["text"]
    assert body["model"] == "judge-test" and body["temperature"] == 0.0


def test_a_flaky_judge_is_retried_until_it_answers():
    with JudgeServer("rule", fail_first=2) as server:
        got = asyncio.run(_judge(server.url, attempts=3).judge(_input(0)))
    assert (got.success, got.attempts, server.requests) == (True, 3, 3)


@pytest.mark.parametrize("mode", ["garbage", "error", "down"])
def test_a_judge_that_gives_no_verdict_says_so_after_its_attempts(mode):
    with JudgeServer("rule" if mode == "down" else mode) as server:
        url = server.url
    if mode != "down":  # served while judging
        with JudgeServer(mode) as server:
            got = asyncio.run(_judge(server.url, attempts=3).judge(_input(0)))
    else:  # nothing listens on the port any more
        got = asyncio.run(_judge(url, attempts=3).judge(_input(0)))
    assert got.success is None and got.attempts == 3 and got.reason.startswith("judge_error: ")
    expected = {"garbage": "UnparseableVerdict", "error": "HTTP 500", "down": "URLError"}[mode]
    assert expected in got.error, got.error


def test_a_refusal_is_not_retried():
    with JudgeServer("refuse") as server:
        got = asyncio.run(_judge(server.url, attempts=3).judge(_input(0)))
    assert (got.success, got.attempts, server.requests) == (None, 1, 1)
    assert "JudgeRefused: HTTP 400" in got.error and "judge-test" in got.error


class _Clicks:
    """A policy that clicks one mark."""

    version = 0

    def __init__(self, mark: int):
        self.mark = mark

    async def act(self, obs):
        from schemas.observation import PolicyOutput

        text = f'{{"thought": "t", "memory": {{}}, "action": {{"kind": "click", "mark": {self.mark}}}}}'
        return PolicyOutput(text, [1], [2], [-0.5], [0])

    async def refresh(self, *args, **kwargs) -> None:
        return None


def _episode(server: JudgeServer | None, mark: int, template: str = "red", store=None) -> list:
    from rollout.episode import EpisodeConfig, EpisodeContext, run_episode

    async def put(png: bytes) -> str:
        return "0" * 64 if store is None else await asyncio.to_thread(store.put, png)

    async def nothing() -> None:
        return None

    events = []
    config = EpisodeConfig(som=True)
    judge = None if server is None else _judge(server.url, attempts=2)
    worker = type("Worker", (), {"worker_id": "w0", "kill": lambda self: None})()  # boxes needs no browser
    ctx = EpisodeContext("r", worker, _Clicks(mark), BoxesSuite(), events.append, put, nothing, config, judge)
    asyncio.run(run_episode(ctx, make_task(template, 3, "train"), "g"))
    return events


def test_an_episode_judged_by_a_model_takes_its_reward_and_records_the_rule_beside_it():
    with JudgeServer("lenient") as server:  # success for any click: the rule says the wrong box failed
        events = _episode(server, mark=1)
    judged = {e.judge: e for e in events if isinstance(e, TrajectoryJudged)}
    (finished,) = [e for e in events if isinstance(e, EpisodeFinished)]
    assert (finished.outcome, finished.reward) == ("success", 1.0)
    assert (judged["model"].success, judged["model"].gives_reward, judged["model"].model) == (True, True, "judge-test")
    assert (judged["rule"].success, judged["rule"].gives_reward) == (False, False)
    assert len(judged["model"].prompt_sha256) == 64 and judged["model"].latency_s > 0
    assert events.index(judged["model"]) < events.index(finished)  # verdicts before the episode's end
    assert not [e for e in _episode(None, mark=1) if isinstance(e, TrajectoryJudged)]  # the rule alone: no event


def test_an_episode_whose_judge_gives_no_verdict_ends_as_judge_error():
    with JudgeServer("error") as server:
        events = _episode(server, mark=0)
    (finished,) = [e for e in events if isinstance(e, EpisodeFinished)]
    model = next(e for e in events if isinstance(e, TrajectoryJudged) and e.judge == "model")
    assert (finished.outcome, finished.reward) == ("judge_error", 0.0)
    assert finished.reason.startswith("judge_error: RuntimeError: HTTP 500")
    assert model.success is None and model.attempts == 2 and "HTTP 500" in model.error


@pytest.mark.filterwarnings("ignore:InitResourceContext.dagster_run:DeprecationWarning")  # Dagster's own
def test_agreement_and_reward_hacking_are_queries_over_the_verdicts(tmp_path):
    """Episodes judged by the rule-following judge and by the lenient one, written as a ledger: the
    agreement table's counts are exact, and the watch finds the lenient judge's hacked successes."""
    from analysis import connect

    from test_analysis import write_ledger

    events = []
    for run, mode in (("rule-judged", "rule"), ("lenient-judged", "lenient")):
        with JudgeServer(mode) as server:
            # red is mark 0: two right clicks, three wrong ones, each its own trajectory
            events += [e.model_copy(update={"run_id": run}) for m in (0, 0, 1, 2, 3) for e in _episode(server, m)]
    with JudgeServer("error") as server:  # a judge that never answered: a judge_error, counted by verify
        events += [e.model_copy(update={"run_id": "unjudged"}) for e in _episode(server, 0)]
    write_ledger(tmp_path, events)
    con = connect(tmp_path)
    from analysis.verify import judge_errors

    assert (judge_errors(con, "unjudged"), judge_errors(con, "lenient-judged"), judge_errors(con)) == (1, 0, 1)
    rows = con.execute(
        "SELECT true_positives, false_positives, false_negatives, true_negatives, accuracy, f1 "
        "FROM awrl_judge_agreement('model', 'rule') WHERE task_family = '(all)'"
    ).fetchall()
    # rule-following judge: 2 right clicks agreed (TP), 3 wrong agreed (TN); lenient: 2 TP, 3 FP
    assert rows == [(4, 3, 0, 3, 0.7, pytest.approx(2 * 4 / (2 * 4 + 3)))]
    hacked = dict(con.execute("SELECT run_id, hacked_share FROM awrl_reward_hacking('rule')").fetchall())
    assert hacked == {"rule-judged": 0.0, "lenient-judged": 0.6}
    by_judge = con.execute("SELECT judge, count(*) FROM verdicts GROUP BY judge ORDER BY judge").fetchall()
    assert by_judge == [("model", 11), ("rule", 11)]  # the unjudged trajectory has both, the model's empty
    # the viewer's trajectory page shows both verdicts, the reward-giving one first
    from analysis.browse import trajectory
    from app.viewer.server import HERE, _num

    tid = next(e.trajectory_id for e in events if isinstance(e, EpisodeFinished) and e.run_id == "lenient-judged")
    found = trajectory(con, "lenient-judged", tid)
    assert [(v["judge"], v["gives_reward"]) for v in found["verdicts"]] == [("model", True), ("rule", False)]
    import jinja2

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(HERE / "templates"), autoescape=True)
    env.globals["page_path"] = lambda *parts: "/" + "/".join(parts)
    env.filters["num"] = _num
    html = env.get_template("trajectory.html").render(run_id="lenient-judged", t=found, problems={})
    assert 'id="verdicts"' in html and "gives the reward" in html and "judge-test" in html
    # re-batched with the rule's verdicts, the lenient run's all-success group becomes informative
    from analysis.rebatch import Admission, rebatch
    from schemas import GroupCompleted

    ended = [e for e in events if isinstance(e, EpisodeFinished) and e.run_id == "lenient-judged"]
    write_ledger(
        tmp_path,
        [
            GroupCompleted(
                run_id="lenient-judged",
                group_id="g",
                task_id=ended[0].task_id,
                trajectory_ids=[e.trajectory_id for e in ended],
                rewards=[e.reward for e in ended],
                num_steps=[e.num_steps for e in ended],
                outcomes=[e.outcome for e in ended],
                min_policy_version=0,
                max_policy_version=0,
            )
        ],
    )
    con = connect(tmp_path)
    assert rebatch(con, "lenient-judged", Admission(eta=9)).dropped == {"uninformative": 1}  # 5 of 5 rewarded
    assert rebatch(con, "lenient-judged", Admission(eta=9, judge="rule")).admitted == ["g"]  # 2 of 5 right
    assert rebatch(con, "lenient-judged", Admission(eta=9, judge="nobody")).dropped == {"judge_error": 1}
    # the Dagster asset is the same table per run, and its check warns on the lenient judge only
    from test_assets import check_results, materialize_run

    for run, agrees in (("rule-judged", True), ("lenient-judged", False)):
        result, _ = materialize_run(str(tmp_path), run, selection=["judge_agreement"])
        assert check_results(result) == {"judge_agrees_with_the_rule": agrees}, run


def test_a_group_with_a_judge_error_is_dropped_by_the_trainer_with_that_reason(settings):
    """Through the real broker: a group one of whose trajectories has no verdict is never trained on
    (neither a success nor a failure), and the drop says why."""
    from pipeline.bus import EventProducer
    from pipeline.hashing import sha256_hex
    from pipeline.store import ScreenshotStore
    from schemas import GroupCompleted, GroupDropped
    from trainer.batch import BatchBuilder
    from trainer.config import TrainConfig

    from samples import sample_group
    from test_train_resume import trainer_events

    run_id = f"judged-{uuid.uuid4().hex[:6]}"
    store = ScreenshotStore.from_settings(settings)
    store.put(PNG)
    events = []
    for e in sample_group(run_id, "g0", [sha256_hex(PNG)], group_size=4, steps=2, seed=3):
        if isinstance(e, GroupCompleted):
            e = e.model_copy(update={"outcomes": ["judge_error", *e.outcomes[1:]]})
        events.append(e)
    producer = EventProducer(settings)
    producer.publish_all(events)
    config = TrainConfig(run_id=run_id, groups_per_update=1, dynamic_sampling=False, batch_timeout_s=5)
    builder = BatchBuilder(settings, config, producer)
    try:
        for _ in range(40):  # a batch timeout is seconds: a loaded machine may need several to join
            assert builder.next_batch(0) is None
            if builder.stats.dropped:
                break
        assert dict(builder.stats.dropped) == {"judge_error": 1}
        builder.commit()
    finally:
        builder.close()
        producer.close()
    drops = [e for e in trainer_events(settings, run_id) if isinstance(e, GroupDropped)]
    assert [(d.group_id, d.reason) for d in drops] == [("g0", "judge_error")]


def test_rejudge_judges_a_recorded_run_again_offline_and_agreement_reads_it(settings, tmp_path):
    """`awrl rejudge` on a run the rule judged (its events on the real broker, its screenshots in the
    store, folded into the ledger): the new verdicts land beside the rule's, and a rule-following model
    judge agrees with it exactly in `awrl agreement`."""
    import subprocess
    import sys

    from pipeline.bus import EventProducer
    from pipeline.ledger import LedgerWriter
    from pipeline.store import ScreenshotStore

    from test_rollout import stack_env

    run_id = f"rejudged-{uuid.uuid4().hex[:6]}"
    store = ScreenshotStore.from_settings(settings)
    events = [
        e.model_copy(update={"run_id": run_id})
        for m, template in ((0, "red"), (1, "red"), (1, "blue"), (2, "red"), (3, "colour"))
        for e in _episode(None, m, template, store=store)
    ]
    producer = EventProducer(settings)
    producer.publish_all(events)
    producer.close()
    LedgerWriter(settings).sync(idle_exit_s=3.0)

    def awrl(*args: str) -> str:
        out = subprocess.run(
            [sys.executable, "-m", "app.cli", *args, "--format", "json"],
            env=stack_env(settings),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout

    with JudgeServer("rule") as server:
        (summary,) = json.loads(awrl("rejudge", run_id, "--url", server.url, "--model", "rule-judge"))
    assert (summary["trajectories"], summary["judge_errors"]) == (5, 0) and server.requests == 5
    rows = {r["task_family"]: r for r in json.loads(awrl("agreement", "rejudged", "rule", "--run", run_id))}
    assert rows["(all)"]["trajectories"] == 5 and rows["(all)"]["accuracy"] == 1.0
    rewards = [e.reward for e in events if isinstance(e, EpisodeFinished)]
    assert sum(rewards) == rows["(all)"]["true_positives"] == 2  # red 0 and blue 1 were right


class _RandomMarks(_Clicks):
    """Clicks a mark drawn from a seeded generator: some right, most wrong."""

    def __init__(self, seed: int):
        import random

        super().__init__(0)
        self.rng = random.Random(seed)

    async def act(self, obs):
        self.mark = self.rng.randrange(4)
        return await super().act(obs)


def test_a_pool_rewarded_by_a_model_judge_that_dies_mid_run_loses_no_verdict(settings):
    """Through the real broker, a pool whose reward comes from the rule-following judge; the judge
    drops four requests in a row unanswered (its process dying mid-request). The trajectories it could
    not judge within their attempts end `judge_error`, the rest agree with the rule exactly, and every
    trajectory has exactly one verdict of each judge in the log: none lost, none twice."""
    from rollout.episode import EpisodeConfig
    from rollout.judges import ModelJudgeConfig
    from rollout.suites.boxes.suite import BoxesSuite

    from test_rollout import by_trajectory, run_pool

    with JudgeServer("rule", drop=range(9, 13)) as server:
        episode = EpisodeConfig(
            som=True, judge="model", model_judge=ModelJudgeConfig(url=server.url, model="rule-judge", attempts=2)
        )
        suite = BoxesSuite()
        tasks = [t for t in suite.tasks("train") if t.task_id.split("-")[1] in ("red", "colour")]
        _, stats, delivered = run_pool(
            settings, suite, _RandomMarks(seed=5), groups=6, workers=2, group_size=4, tasks=tasks, episode=episode
        )
    assert server.dropped == 4
    finished, verdicts = {}, {}
    for tid, events in by_trajectory(delivered).items():
        (finished[tid],) = [e for e in events if isinstance(e, EpisodeFinished)]
        judged = [e for e in events if isinstance(e, TrajectoryJudged)]
        assert sorted(j.judge for j in judged) == ["model", "rule"], (tid, judged)
        verdicts[tid] = {j.judge: j for j in judged}
    assert len(finished) == stats.episodes == 24
    errors = [t for t, f in finished.items() if f.outcome == "judge_error"]
    assert 1 <= len(errors) == stats.judge_errors <= 2, errors
    for tid, f in finished.items():
        model, rule = verdicts[tid]["model"], verdicts[tid]["rule"]
        if tid in errors:
            assert model.success is None and model.attempts == 2 and f.reward == 0.0
        else:
            assert model.success == rule.success == (f.outcome == "success") and f.reward == float(model.success)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_run_trained_from_a_model_judges_rewards_agrees_with_the_rule_and_replays_without_it(settings, tmp_path):
    """`awrl run` on boxes, every reward a verdict of the rule-following model judge (real HTTP): it
    trains, its verdicts agree with the rule's exactly, and replay is bit-exact with the judge gone."""
    from dataclasses import replace

    from analysis import connect
    from analysis.replay import replay
    from app.training import RunConfig, run_training
    from rollout.episode import EpisodeConfig
    from rollout.judges import ModelJudgeConfig
    from trainer.config import TrainConfig

    settings = settings.model_copy(update={"ledger_uri": str(tmp_path / "ledger")})
    with JudgeServer("rule") as server:
        model_judge = ModelJudgeConfig(url=server.url, model="rule-judge")
        judged = EpisodeConfig(som=True, judge="model", model_judge=model_judge)
        rollout = replace(RunConfig().rollout, suite="boxes", policy="demo", noise=0.5, templates=("red",))
        config = RunConfig(
            minutes=15.0,  # only a cap: the run ends at its updates
            rollout=replace(rollout, episode=judged),
            train=TrainConfig(run_id="", groups_per_update=1, dynamic_sampling=False, max_updates=2),
            log_dir=tmp_path / "runs",
        )
        summary = run_training(settings, config)
    assert summary.updates == 2 and not summary.stopped, summary
    con = connect(settings.ledger_uri)
    (row,) = con.execute(
        "SELECT trajectories, accuracy FROM awrl_judge_agreement('model', 'rule') WHERE task_family = '(all)'"
    ).fetchall()
    finished = con.execute(
        "SELECT count(*), sum(reward) FROM episode_finished WHERE run_id = ? AND outcome IN ('success', 'failure')",
        [summary.run_id],
    ).fetchone()
    rewarded = con.execute(
        "SELECT sum(success::INT) FROM verdicts WHERE run_id = ? AND gives_reward", [summary.run_id]
    ).fetchone()
    assert row == (finished[0], 1.0) and finished[1] == rewarded[0], (row, finished, rewarded)
    # `awrl report` draws the reward-hacking watch for a run a model judge rewarded
    from analysis import write_report

    md = write_report(con, summary.run_id, tmp_path / "report").read_text()
    assert (tmp_path / "report" / "reward_hacking.png").stat().st_size > 0 and "reward_hacking.png" in md
    results = replay(settings, summary.run_id)  # the judge's server is closed: replay never asks it
    assert len(results) == 2 and all(b.exact for b in results), [b.exact for b in results]
