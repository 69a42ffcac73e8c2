"""Analysis over the ledger: views, exact drift metrics on hand-built trajectories, read-only SQL, CLI.

The run `r1` below is small enough to work every metric out by hand; the arithmetic is in the
comments next to each expected number.
"""

from __future__ import annotations

import json
import math
import uuid
from collections import defaultdict

import duckdb
import pyarrow.parquet as pq
import pytest
import typer
from typer.testing import CliRunner

from analysis import RAW_VIEWS, VIEWS, DriftConfig, connect, drift_metrics, write_report
from app import output
from app.analysis_cli import BadParameters, NotReadOnly, check_read_only, register, run_query
from schemas import (
    Action,
    EpisodeFinished,
    EpisodeStarted,
    EvaluationCompleted,
    GroupCompleted,
    StepRecorded,
    StepTimings,
    UpdateApplied,
    arrow_schema,
    events_to_table,
)
from trainer.advantages import group_advantages

SHA = "ab" * 32
KETTLE = "Find the price of the blue kettle"  # content words: price, blue, kettle
CURIE = "Open the article about Marie Curie"  # content words: open, article, marie, curie


def step(run, tid, gid, s, keys, versions, policy_version=0):
    return StepRecorded(
        run_id=run,
        trajectory_id=tid,
        group_id=gid,
        task_id=gid,
        step=s,
        screenshot_sha256=SHA,
        url="http://x/",
        action=Action(kind="click", x=1, y=2),
        response_text="r",
        memory={k: "v" for k in keys},
        prompt_token_ids=[7],
        prompt_screenshot_sha256=[SHA],
        response_token_ids=list(range(len(versions))),
        behave_logprobs=[-0.5] * len(versions),
        token_policy_versions=versions,
        policy_version=policy_version,
        env_feedback="ok",
        timings=StepTimings(policy_s=0.1, browser_s=0.1, wait_s=0.1),
    )


def trajectory(run, tid, gid, instruction, steps, outcome=None, reason="judge", start_version=0):
    """EpisodeStarted, the steps [(keys, token versions, policy version)], and EpisodeFinished if `outcome`."""
    events = [
        EpisodeStarted(
            run_id=run,
            trajectory_id=tid,
            group_id=gid,
            task_id=gid,
            worker_id="w",
            instruction=instruction,
            horizon=10,
            policy_version=start_version,
        )
    ]
    events += [step(run, tid, gid, s, keys, versions, pv) for s, (keys, versions, pv) in enumerate(steps)]
    if outcome:
        events.append(
            EpisodeFinished(
                run_id=run,
                trajectory_id=tid,
                group_id=gid,
                task_id=gid,
                outcome=outcome,
                reward=float(outcome == "success"),
                num_steps=len(steps),
                reason=reason,
            )
        )
    return events


def update(run, n, version_before, tids, stats):
    return UpdateApplied(
        run_id=run,
        update_step=n,
        version_before=version_before,
        version_after=version_before + 1,
        group_ids=[],
        trajectory_ids=tids,
        loss=0.0,
        grad_norm=1.0,
        stats=stats,
        config_json="{}",
        weights_sha256=SHA,
        duration_s=1.0,
    )


def group(run, gid, tids, rewards, outcomes, steps):
    return GroupCompleted(
        run_id=run,
        group_id=gid,
        task_id=gid,
        trajectory_ids=tids,
        rewards=rewards,
        num_steps=steps,
        outcomes=outcomes,
        min_policy_version=0,
        max_policy_version=2,
    )


def run_r1() -> list:
    bkp = ["blue kettle price"]
    return [
        *trajectory("r1", "A", "g1", KETTLE, [(bkp, [1, 1, 1], 1), (bkp, [2, 2], 2)], "success"),
        *trajectory(
            "r1",
            "B",
            "g1",
            KETTLE,
            [
                (["kettle"], [1], 1),
                (["kettle", "step_1"], [1, 1], 1),
                (["kettle", "step_1", "current_page"], [2], 2),
                (["kettle", "step_1", "current_page"], [2, 2, 2, 2], 2),
            ],
            "failure",
        ),
        *trajectory(
            "r1",
            "C",
            "g2",
            CURIE,
            [(["notes"], [0, 0], 0), (["notes", "Curie birth year"], [0], 0), (["notes", "Curie birth year"], [], 0)],
            "failure",
        ),  # a step without tokens
        *trajectory("r1", "D", "g2", CURIE, [(["Weather today"], [1], 1)], "env_error", reason="browser_crash"),
        group("r1", "g1", ["A", "B"], [1.0, 0.0], ["success", "failure"], [2, 4]),
        group("r1", "g2", ["C", "D"], [0.0, 0.0], ["failure", "env_error"], [3, 1]),
        update("r1", 0, 3, ["A", "B"], {"clip_frac": 0.1}),
        update(
            "r1",
            1,
            4,
            ["A"],
            {
                "clip_frac": 0.3,
                "kl": 0.01,
                "mismatch_tokens": 8.0,
                "mismatch_nonfinite": 0.0,
                "mismatch_k3": 0.002,
                "mismatch_stale_tokens": 2.0,
                "mismatch_stale_k3": 0.05,
            },
        ),
        update(
            "r1",
            2,
            5,
            ["C"],
            {
                "kl": 0.02,
                "mismatch_tokens": 0.0,
                "mismatch_nonfinite": 0.0,
                "mismatch_k3": 0.0,
                "mismatch_stale_tokens": 3.0,
                "mismatch_stale_k3": 0.07,
            },
        ),  # no clip fraction
    ]


def run_r2() -> list:
    """Another run in the same ledger, still running: must never leak into r1's numbers."""
    return trajectory("r2", "E", "g9", KETTLE, [(["task_1"], [9, 9], 9)])


def write_ledger(root, events, summaries=lambda is_a: False) -> None:
    """The ledger writer's layout: one file per (run, type) batch; A's steps split over two files.
    `summaries(is_a)`: whether that file gets the token summaries (files from before them do not)."""
    from pipeline.summaries import with_summaries

    batches = defaultdict(list)
    for e in events:
        batches[(e.run_id, type(e).__name__, getattr(e, "trajectory_id", "") == "A")].append(e)
    for (run, kind, is_a), batch in batches.items():
        directory = root / f"run_id={run}" / f"event_type={kind}"
        directory.mkdir(parents=True, exist_ok=True)
        table = events_to_table(batch)
        pq.write_table(
            with_summaries(kind, table) if summaries(is_a) else table,
            directory / f"part-{uuid.uuid4().hex[:8]}.parquet",
        )


@pytest.fixture(scope="module")
def ledger(tmp_path_factory):
    root = tmp_path_factory.mktemp("ledger")
    write_ledger(root, run_r1() + run_r2())
    return root


@pytest.fixture()
def con(ledger):
    c = connect(ledger)
    yield c
    c.close()


def test_drift_metrics_are_exact(con):
    r = drift_metrics(con, "r1")
    # distinct (trajectory, key) pairs: A 1 + B 3 + C 2 + D 1 = 7. Generic: step_1, current_page, notes
    # by pattern; "Weather today" shares no word with CURIE. "Curie birth year" shares "curie".
    assert (r.distinct_keys, r.generic_by_pattern, r.generic_by_overlap_only) == (7, 3, 1)
    assert r.generic_key_ratio == pytest.approx(4 / 7)
    # first = last key set: A yes, B no, C no; D has one step and is left out -> 1/3
    assert (r.multi_step_trajectories, r.first_last_stable_ratio) == (3, pytest.approx(1 / 3))
    # adjacent pairs: A 1/1 unchanged, B 1/3 (steps 2-3), C 1/2 (steps 1-2) -> 3/6
    assert (r.adjacent_pairs, r.adjacent_unchanged_ratio) == (6, 0.5)
    # keys at step 0: 1,1,1,1; step 1: 1,2,2; step 2: 3,2; step 3: 3
    assert [(k["step"], k["steps"], k["mean_keys"]) for k in r.keys_by_step] == [
        (0, 4, 1.0),
        (1, 3, pytest.approx(5 / 3)),
        (2, 2, 2.5),
        (3, 1, 3.0),
    ]
    # x mean 1, y mean 1.7; Sxy = 4*0.7 + 1.3 + 0.3 + 2*1.3 = 7.0, Sxx = 4 + 2 + 4 = 10 -> 0.7
    assert r.keys_per_step_slope == pytest.approx(0.7)
    assert (r.steps, r.trajectories) == (10, 4)
    # tokens of the 9 steps that have any: 3+2 + 1+2+1+4 + 2+1 + 1 = 17
    assert r.mean_response_tokens == pytest.approx(17 / 9)
    # success A: 2 steps; failures B 4, C 3 -> 3.5; env_error D is neither. 3.5 / 2 = 1.75
    assert (r.successes, r.failures, r.success_mean_steps, r.failure_mean_steps) == (1, 2, 2.0, 3.5)
    assert r.length_downweight == pytest.approx(1.75)
    # update 0 (before v3) trains A: 3*(3-1) + 2*(3-2) = 8 over 5 tokens; B: 2 + 2*2 + 1 + 4*1 = 11 over 8
    # update 1 (v4) trains A again: 3*3 + 2*2 = 13 over 5; update 2 (v5) trains C: 5+5 + 5 = 15 over 3
    assert r.trained_tokens == 21
    assert r.offpolicy_gap_mean == pytest.approx((8 + 11 + 13 + 15) / 21)
    assert r.offpolicy_gap_max == 5
    # clip_frac 0.1 and 0.3; update 2 did not report one
    assert r.updates == 3
    assert [c["update_step"] for c in r.clip_rate_by_update] == [0, 1]
    assert r.clip_rate_mean == pytest.approx(0.2)


@pytest.mark.parametrize("summaries", [lambda is_a: True, lambda is_a: is_a], ids=["all", "mixed"])
def test_token_summaries_give_the_array_pass_metrics(con, tmp_path, summaries):
    """Files with the ledger's token summaries (all, or beside older files without) give exactly the
    metrics of the arrays (`con`: a ledger written before the summaries existed)."""
    write_ledger(tmp_path, run_r1() + run_r2(), summaries)
    summarized = connect(tmp_path)
    counts = summarized.execute(
        "SELECT (SELECT count(*) FROM step_recorded_summarized), (SELECT count(*) FROM step_recorded_unsummarized)"
    ).fetchone()
    assert counts[0] > 0 and (counts[1] > 0) == (summaries(False) is False)
    assert drift_metrics(summarized, "r1").to_dict() == drift_metrics(con, "r1").to_dict()


def test_drift_config_is_respected(con):
    r = drift_metrics(con, "r1", DriftConfig(generic_key_patterns=(r"notes",), token_metrics=False))
    assert (r.generic_by_pattern, r.generic_by_overlap_only) == (1, 3)  # step_1, current_page: no content word
    assert r.mean_response_tokens is None and r.offpolicy_gap_mean is None
    r = drift_metrics(con, "r1", DriftConfig(stop_words=(), min_word_len=1))
    assert r.generic_by_overlap_only == 1  # "Weather today" still shares nothing with CURIE


def test_run_without_updates_or_finishes_has_none(con):
    r = drift_metrics(con, "r2")
    assert (r.steps, r.updates, r.offpolicy_gap_mean, r.clip_rate_mean, r.length_downweight) == (1, 0, None, None, None)
    assert r.generic_key_ratio == 1.0  # task_1
    assert r.first_last_stable_ratio is None and r.adjacent_unchanged_ratio is None
    assert json.dumps(r.to_dict())


def test_trajectories_view(con):
    rows = con.execute(
        "SELECT trajectory_id, outcome, num_steps, response_tokens, min_policy_version, "
        "max_policy_version, env_error_reason, instruction FROM trajectories "
        "ORDER BY run_id, trajectory_id"
    ).fetchall()
    assert rows == [
        ("A", "success", 2, 5, 1, 2, None, KETTLE),
        ("B", "failure", 4, 8, 1, 2, None, KETTLE),
        ("C", "failure", 3, 3, 0, 0, None, CURIE),
        ("D", "env_error", 1, 1, 1, 1, "browser_crash", CURIE),
        ("E", None, 1, 2, 9, 9, None, KETTLE),  # r2, still running: steps recorded so far
    ]


def test_groups_view_uses_the_trainers_advantages(con):
    rows = con.execute(
        "SELECT group_id, rewards, advantages, informative FROM groups WHERE run_id = $run ORDER BY group_id",
        {"run": "r1"},
    ).fetchall()
    assert [(g, i) for g, _, _, i in rows] == [("g1", True), ("g2", False)]  # all-equal rewards teach nothing
    for _, rewards, advantages, _ in rows:
        assert advantages == group_advantages(rewards)
    assert rows[1][2] == [0.0, 0.0]


def test_updates_and_step_views(con):
    assert con.execute(
        "SELECT update_step, clip_frac, num_trajectories FROM updates WHERE run_id = 'r1' ORDER BY update_step"
    ).fetchall() == [(0, 0.1, 2), (1, 0.3, 1), (2, None, 1)]
    # the sampler-vs-trainer columns: NULL before they were recorded (0) and without fresh tokens (2)
    assert con.execute(
        "SELECT update_step, mismatch_tokens, mismatch_k3, mismatch_stale_k3 FROM updates "
        "WHERE run_id = 'r1' ORDER BY update_step"
    ).fetchall() == [(0, None, None, None), (1, 8.0, 0.002, 0.05), (2, 0.0, None, 0.07)]
    assert con.execute(
        "SELECT memory_keys, num_keys, response_tokens FROM steps WHERE trajectory_id = 'B' AND step = 2"
    ).fetchall() == [(["current_page", "kettle", "step_1"], 3, 1)]


def test_missing_event_types_give_empty_views_with_columns(tmp_path):
    write_ledger(tmp_path, run_r2())  # no GroupCompleted, UpdateApplied, ... files at all
    for root in (tmp_path, tmp_path / "never-written"):
        con = connect(root)
        for view, cls in RAW_VIEWS.items():
            columns = [c[0] for c in con.execute(f"DESCRIBE {view}").fetchall()]
            assert columns == arrow_schema(cls).names
        for view in VIEWS:
            con.execute(f"SELECT * FROM {view}").fetchall()
        assert con.execute("SELECT count(*) FROM groups").fetchone() == (0,)
        assert drift_metrics(con, "nope").steps == 0
        con.close()
    assert not (tmp_path / "never-written").exists()  # reading never creates the ledger


REFUSED = [
    "DROP VIEW steps",
    "INSERT INTO steps SELECT * FROM steps",
    "WITH x AS (SELECT 1) INSERT INTO t SELECT * FROM x",
    "COPY steps TO 'out.csv'",
    "COPY (SELECT 1) TO 'out.parquet' (FORMAT parquet)",
    "EXPLAIN ANALYZE COPY (SELECT 1) TO 'out.csv'",
    "ATTACH 'other.db'",
    "DETACH memory",
    "INSTALL httpfs",
    "LOAD httpfs",
    "SET threads = 1",
    "RESET threads",
    "PRAGMA version",
    "CALL pragma_version()",
    "CREATE TABLE t AS SELECT 1",
    "DELETE FROM steps",
    "EXPORT DATABASE 'dump'",
    "SELECT 1; DROP VIEW steps",
    "SELECT 1; SELECT 2",
    "",
]
ALLOWED = [
    "SELECT count(*) FROM steps",
    "WITH t AS (SELECT 1 AS a) SELECT a FROM t",
    "DESCRIBE steps",
    "SHOW TABLES",
    "EXPLAIN SELECT * FROM steps",
    "FROM trajectories",
    "SUMMARIZE updates",
    "VALUES (1)",
]


@pytest.mark.parametrize("query", REFUSED)
def test_sql_refuses_anything_but_one_query(con, query):
    with pytest.raises(NotReadOnly):
        check_read_only(con, query)


@pytest.mark.parametrize("query", ALLOWED)
def test_sql_allows_queries(con, query):
    run_query(con, query)


def test_locked_connection_reaches_nothing_outside_the_ledger(con, tmp_path):
    with pytest.raises(duckdb.PermissionException):
        con.execute("SELECT * FROM read_csv('/etc/passwd')")
    with pytest.raises(duckdb.Error):
        con.execute(f"COPY (SELECT 1) TO '{tmp_path / 'x.csv'}'")
    with pytest.raises(duckdb.Error):
        con.execute("SET enable_external_access = true")
    assert not (tmp_path / "x.csv").exists()


@pytest.fixture()
def cli():
    app = typer.Typer()
    register(app)
    return lambda *args: CliRunner().invoke(app, [str(a) for a in args])


def test_cli_sql_formats_and_a_wide_result_is_shown_whole(cli, ledger):
    query = "SELECT trajectory_id, outcome FROM trajectories WHERE run_id = 'r1' ORDER BY 1"
    lines = cli("sql", query, "--format", "csv", "--ledger", ledger).output.splitlines()
    assert lines[0] == "trajectory_id,outcome" and len(lines) == 5 and lines[1].endswith(",success")
    lines = cli("sql", query, "-f", "markdown", "--ledger", ledger).output.splitlines()
    assert lines[:2] == ["| trajectory_id | outcome |", "|---|---|"] and len(lines) == 6
    narrow = cli("sql", query, "--ledger", ledger).output
    assert "┃ trajectory_id" in narrow  # fits: a table
    wide_query = "SELECT *, repeat('x', 150) AS long_text FROM trajectories WHERE run_id = 'r1'"
    wide = cli("sql", wide_query, "--ledger", ledger).output  # not a terminal: as wide as it needs
    assert "…" not in wide and "x" * 150 in wide and "-[ record" not in wide
    with output.console.capture() as captured:  # an 80-column terminal: one block per record, nothing cut
        output.console.width, width = 80, output.console.width
        try:
            output.emit_rows(["a", "long_text"], [("1", "x" * 150)], output.Format.table)
        finally:
            output.console.width = width
    lines = captured.get().splitlines()
    assert "-[ record 1 ]" in lines[0] and lines[-1] == "long_text | " + "x" * 150


def test_cli_sql_drift_and_report(cli, ledger, tmp_path):
    res = cli(
        "sql",
        "SELECT trajectory_id, outcome FROM trajectories WHERE run_id = 'r1' ORDER BY 1",
        "--format",
        "json",
        "--ledger",
        ledger,
    )
    assert res.exit_code == 0, res.output
    assert [r["outcome"] for r in json.loads(res.output)] == ["success", "failure", "failure", "env_error"]
    assert cli("sql", "SELECT * FROM steps", "--limit", "3", "--ledger", ledger).exit_code == 0
    res = cli("sql", f"COPY steps TO '{tmp_path / 'x.csv'}'", "--ledger", ledger)
    assert res.exit_code == 2 and "refused" in res.output and not (tmp_path / "x.csv").exists()
    res = cli("drift", "r1", "--format", "json", "--ledger", ledger)
    assert res.exit_code == 0, res.output
    assert math.isclose(json.loads(res.output)["generic_key_ratio"], 4 / 7)
    assert cli("drift", "r1", "--no-tokens", "--ledger", ledger).exit_code == 0
    res = cli("report", "r1", "--out", tmp_path / "rep", "--ledger", ledger)
    assert res.exit_code == 0, res.output
    names = {p.name for p in (tmp_path / "rep").iterdir()}
    assert names == {"report.md", "keys_per_step.png", "lengths.png", "success_over_time.png", "learning_curve.png"}
    assert "generic_key_ratio | 57.1% | 34% | 11%" in (tmp_path / "rep" / "report.md").read_text()


def test_report_of_an_empty_run(con, tmp_path):
    path = write_report(con, "nope", tmp_path)
    assert "No finished trajectories" in path.read_text() and list(tmp_path.glob("*.png")) == []


@pytest.mark.slow
def test_views_over_an_s3_ledger_match_the_local_ones(stack, ledger):
    from pipeline.ledger import LedgerWriter

    settings = stack.settings()
    settings = settings.model_copy(update={"ledger_uri": f"s3://{settings.s3_bucket}/analysis-{uuid.uuid4().hex[:8]}"})
    writer = LedgerWriter(settings)
    batches = defaultdict(list)
    for e in run_r1() + run_r2():
        batches[(e.run_id, type(e).__name__)].append(e)
    for (run, kind), batch in batches.items():
        writer._write(run, kind, batch)
    s3, local = connect(settings), connect(ledger)
    query = "SELECT * EXCLUDE (started_at, finished_at) FROM trajectories ORDER BY trajectory_id"
    assert s3.execute(query).fetchall() == local.execute(query).fetchall()
    expected = drift_metrics(local, "r1").to_dict()
    assert drift_metrics(s3, "r1").to_dict() == expected


def test_learning_curve_from_the_evaluations_view(tmp_path):
    from analysis.curves import evaluation_points, learning_curve_png
    from schemas import EvaluationCompleted

    def point(stage, successes, train_s):
        return EvaluationCompleted(
            run_id="L",
            stage=stage,
            eval_run_id=f"L-eval-{stage}",
            policy_version=0,
            suite="miniwob",
            split="test",
            episodes=100,
            successes=successes,
            ci95_low=0.0,
            ci95_high=1.0,
            train_s=train_s,
        )

    write_ledger(tmp_path / "ledger", [point("rl", 61, 700.0), point("untrained", 1, 0.0), point("sft", 48, 100.0)])
    con = connect(tmp_path / "ledger")
    rows = con.execute("select stage, success_rate from evaluations where run_id = 'L' order by train_s").fetchall()
    assert rows == [("untrained", 0.01), ("sft", 0.48), ("rl", 0.61)]
    points = evaluation_points(con, "L")
    assert [p.stage for p in points] == ["untrained", "sft", "rl"] and points[2].rate == 0.61
    png = learning_curve_png(points, tmp_path / "curve.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="no evaluations"):
        learning_curve_png([], tmp_path / "empty.png")


def run_lc() -> list:
    """A run whose trajectories belong to versions 0, 1 and 2 (the oldest version that acted), beside its
    evaluation run `lc-eval-rl` (a run of its own) and the run's held-out evaluations."""

    def traj(tid, outcome, versions, start=0):  # one step per version in `versions`
        return trajectory("lc", tid, "g", KETTLE, [(["k"], [v], v) for v in versions], outcome, start_version=start)

    def evaluation(stage, version, successes):
        return EvaluationCompleted(
            run_id="lc",
            stage=stage,
            eval_run_id=f"lc-eval-{stage}",
            policy_version=version,
            suite="sites",
            split="heldout",
            episodes=20,
            successes=successes,
            ci95_low=0.0,
            ci95_high=1.0,
        )

    return [
        *traj("a", "success", [0]),
        *traj("b", "failure", [0, 0]),
        *traj("c", "env_error", [0]),
        *traj("d", "success", [1], start=0),  # v1 arrived before its first step: v1's trajectory
        *traj("e", "success", [1, 2]),
        *traj("f", "failure", [1]),
        *traj("g", "failure", [1, 1]),
        *traj("h", "success", [2], start=1),
        *traj("i", "env_error", [], start=2),  # no step: start version
        *traj("j", None, [2], start=2),  # still running: not counted
        *trajectory("lc-eval-rl", "x", "g", KETTLE, [(["k"], [2], 2)], "success", start_version=2),
        evaluation("untrained", 0, 1),
        evaluation("sft", 0, 8),
        evaluation("rl-v2", 2, 12),
    ]


@pytest.fixture()
def lc(tmp_path):
    write_ledger(tmp_path / "ledger", run_lc())
    c = connect(tmp_path / "ledger")
    yield c
    c.close()


def test_success_by_version_counts_finished_trajectories_by_their_oldest_version(lc):
    from rollout.evaluate import wilson_interval

    rows = lc.sql("select * from success_by_version where run_id = 'lc' order by policy_version").fetchall()
    # v0: a success, b failure, c env_error (not a success) -> 1/3
    # v1: d success (started on v0, acted on v1), e success (v1 then v2), f, g failures -> 2/4
    # v2: h success (started on v1), i env_error without a step (start version 2); j is running -> 1/2
    assert [r[1:5] for r in rows] == [(0, 3, 1, 1), (1, 4, 2, 0), (2, 2, 1, 1)]
    assert [r[5] for r in rows] == [pytest.approx(1 / 3), 0.5, 0.5]
    for _, _, n, k, _, _, low, high in rows:
        assert (low, high) == pytest.approx(wilson_interval(k, n), abs=1e-12)
    assert lc.sql("select trajectories, successes from success_by_version where run_id = 'lc-eval-rl'").fetchall() == [
        (1, 1)
    ]  # the evaluation run is a run of its own
    assert lc.execute("select awrl_wilson(0, 0)").fetchone() == ({"low": 0.0, "high": 1.0},)


def test_curve_by_version_plots_training_success_and_evaluations(lc, tmp_path):
    from analysis.curves import evaluation_points, success_by_version, version_curve_png

    training = success_by_version(lc, "lc")
    assert training.column_names[:3] == ["policy_version", "trajectories", "successes"]
    points = evaluation_points(lc, "lc")
    assert [(p.stage, p.policy_version) for p in points] == [("untrained", 0), ("sft", 0), ("rl-v2", 2)]
    assert version_curve_png(training, [], tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"  # training only
    with pytest.raises(ValueError, match="no finished trajectories or evaluations"):
        version_curve_png(success_by_version(lc, "nope"), [], tmp_path / "empty.png")
    report = write_report(lc, "lc", tmp_path / "rep")
    assert (tmp_path / "rep" / "learning_curve.png").read_bytes()[:4] == b"\x89PNG"
    assert "![learning_curve](learning_curve.png)" in report.read_text() and "success_by_version" in report.read_text()
    from analysis.curves import compare_versions_png  # a run beside its control, one line each

    pair = {"run": training, "control": training}
    assert compare_versions_png(pair, tmp_path / "pair.png").read_bytes()[:4] == b"\x89PNG"


def test_lineage_lists_exactly_the_updates_recorded_for_a_version(tmp_path, cli):
    from analysis.lineage import lineage
    from schemas import PolicyVersionPublished

    run = "lin"
    events = []
    for tid, outcome, pv in (("A", "success", 0), ("B", "failure", 0), ("C", "success", 1), ("D", "failure", 2)):
        events += trajectory(run, tid, f"g{tid}", KETTLE, [(["k"], [pv], pv), (["k"], [pv], pv)], outcome)
    ups = [update(run, 0, 0, ["A", "B"], {}), update(run, 1, 1, ["C"], {}), update(run, 2, 2, ["D"], {})]
    versions = [PolicyVersionPublished(run_id=run, version=0, checkpoint_uri="s3://b/v0", checkpoint_sha256=SHA)]
    versions += [
        PolicyVersionPublished(
            run_id=run,
            version=u.version_after,
            checkpoint_uri=f"s3://b/v{u.version_after}",
            checkpoint_sha256=SHA,
            update_step=u.update_step,
            parent_version=u.version_before,
            update_ids=[u.event_id],
        )
        for u in ups
    ]
    write_ledger(tmp_path / "ledger", events + ups + versions)
    con = connect(tmp_path / "ledger")

    two = lineage(con, run, 2)
    assert two.versions == [0, 1, 2]
    assert [u["event_id"] for u in two.updates] == [ups[0].event_id, ups[1].event_id]
    assert sorted(two.trajectories) == ["A", "B", "C"] and two.tasks == {"gA": 1, "gB": 1, "gC": 1}
    assert two.outcomes == {"success": 2, "failure": 1} and two.behaviour_versions == {0: 4, 1: 2}
    assert lineage(con, run, 0).updates == []
    assert [u["update_step"] for u in lineage(con, run, 3).updates] == [0, 1, 2]
    with pytest.raises(KeyError, match="no published version 9"):
        lineage(con, run, 9)
    res = cli("lineage", run, 2, "--format", "json", "--ledger", tmp_path / "ledger")
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["versions"] == [0, 1, 2]
    assert cli("lineage", run, 3, "--ledger", tmp_path / "ledger").exit_code == 0
    res = cli("lineage", run, 9, "--ledger", tmp_path / "ledger")
    assert res.exit_code == 2 and "no published version 9" in res.output


def test_rebatch_judges_every_completed_group_by_the_trainers_filters(tmp_path, cli):
    from datetime import UTC, datetime, timedelta

    from analysis.rebatch import Admission, rebatch
    from schemas import GroupDropped, PolicyVersionPublished

    run, t0 = "rb", datetime(2026, 1, 1, tzinfo=UTC)

    def at(seconds):
        return {"emitted_at": t0 + timedelta(seconds=seconds)}

    versions = [
        PolicyVersionPublished(
            run_id=run, version=v, checkpoint_uri=f"s3://b/v{v}", checkpoint_sha256=SHA, **at(100 * v)
        )
        for v in range(4)
    ]  # v0 at 0 s, v1 at 100 s, ...
    # (group, completed at s, oldest token version, rewards)
    spec = [
        ("a", 50, 0, [1.0, 0.0]),
        ("b", 150, 1, [1.0, 0.0]),
        ("c", 250, 0, [0.0, 1.0]),
        ("d", 350, 0, [1.0, 0.0]),
        ("e", 360, 3, [0.0, 0.0]),
        ("f", 370, 3, [1.0, 1.0]),
    ]
    events = []
    for gid, t, oldest, rewards in spec:
        tids = [f"{gid}{i}" for i in range(len(rewards))]
        for tid in tids:
            events += trajectory(run, tid, gid, KETTLE, [(["k"], [oldest], oldest)])
        events.append(
            GroupCompleted(
                run_id=run,
                group_id=gid,
                task_id=gid,
                trajectory_ids=tids,
                rewards=rewards,
                num_steps=[1] * len(tids),
                outcomes=["success" if r else "failure" for r in rewards],
                min_policy_version=oldest,
                max_policy_version=oldest,
                **at(t),
            )
        )
    events += [
        update(run, 0, 0, ["a0", "a1"], {}).model_copy(update={"group_ids": ["a"]}),
        GroupDropped(
            run_id=run, group_id="e", task_id="e", reason="uninformative", trainer_version=3, min_policy_version=3
        ),
    ]
    write_ledger(tmp_path / "ledger", events + versions)
    con = connect(tmp_path / "ledger")

    on_policy = rebatch(con, run, Admission(eta=0))  # current version at completion: a 0, b 1, c 2, d 3, e 3, f 3
    assert on_policy.admitted == ["a", "b"] and on_policy.dropped == {"stale": 2, "uninformative": 2}
    assert on_policy.per_version == {0: 1, 1: 1} and on_policy.staleness == {0: 2}
    assert on_policy.recorded == {"trained": 1, "uninformative": 1}
    assert rebatch(con, run, Admission(eta=2)).admitted == ["a", "b", "c"]
    keep_all = rebatch(con, run, Admission(eta=3, filter="none"))
    assert keep_all.admitted == ["a", "b", "c", "d", "e", "f"] and keep_all.staleness == {0: 4, 2: 1, 3: 1}
    assert keep_all.advantages[-2:] == [0.0, 0.0]  # an all-equal group teaches nothing
    assert rebatch(con, run, Admission(eta=3, filter="raft")).admitted == ["a", "b", "c", "d", "f"]
    res = cli("rebatch", run, "--eta", 0, "--format", "json", "--ledger", tmp_path / "ledger")
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["admitted"] == ["a", "b"]
    res = cli("rebatch", run, "--png", tmp_path / "rb.png", "--ledger", tmp_path / "ledger")
    assert res.exit_code == 0 and (tmp_path / "rb.png").read_bytes()[:4] == b"\x89PNG"
    assert cli("rebatch", run, "--filter", "bogus", "--ledger", tmp_path / "ledger").exit_code == 2


INJECTION = "x' OR 1=1; DROP VIEW steps; --"


def test_sql_params_are_bound_as_data_never_as_sql(con):
    steps = con.execute("SELECT count(*) FROM steps").fetchall()
    query = "SELECT trajectory_id FROM trajectories WHERE trajectory_id = $tid"
    assert run_query(con, query, params={"tid": INJECTION}) == (["trajectory_id"], [], False)
    assert run_query(con, query, params={"tid": "B"})[1] == [("B",)]
    assert con.execute("SELECT count(*) FROM steps").fetchall() == steps  # the view is still there
    with pytest.raises(BadParameters, match=r"uses \$tid but no value"):
        run_query(con, query)
    with pytest.raises(BadParameters, match="extra not used"):
        run_query(con, query, params={"tid": "B", "extra": "1"})
    with pytest.raises(NotReadOnly):  # a parameter does not make a write statement acceptable
        run_query(con, "DELETE FROM steps WHERE trajectory_id = $tid", params={"tid": "B"})


def test_cli_sql_binds_params_and_explains_bad_ones(cli, ledger):
    query = "SELECT trajectory_id, num_steps FROM trajectories WHERE run_id = $run AND num_steps >= $n::INT ORDER BY 1"
    res = cli("sql", query, "-p", "run=r1", "--param", "n=3", "--format", "json", "--ledger", ledger)
    assert res.exit_code == 0, res.output
    assert json.loads(res.output) == [{"trajectory_id": "B", "num_steps": 4}, {"trajectory_id": "C", "num_steps": 3}]
    res = cli("sql", query, "-p", f"run={INJECTION}", "-p", "n=0", "--format", "json", "--ledger", ledger)
    assert res.exit_code == 0 and json.loads(res.output) == []
    for bad, message in (("run", "name=value"), ("=r1", "name=value"), ("run=r1", "$n but no value")):
        res = cli("sql", query, "-p", bad, "--ledger", ledger)
        assert res.exit_code == 2 and message in res.output, res.output
    res = cli("sql", "SELECT 1", "-p", "run=r1", "-p", "run=r2", "--ledger", ledger)
    assert res.exit_code == 2 and "given twice" in res.output
