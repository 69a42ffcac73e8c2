"""What the trajectory viewer shows, as queries over the ledger's views: runs, one run's curves,
trajectories and groups, one trajectory's steps, one group, one update.

Every function takes a connection from `analysis.connect` and returns plain rows (dicts), so the viewer
(`app.viewer`) renders and the exports (`analysis.export`) write the same numbers. A missing run,
trajectory, group or update is `None` (the viewer's 404), never an exception.
"""

from __future__ import annotations

from urllib.parse import quote

import duckdb

from analysis.views import load_sql

OUTCOMES = ("success", "failure", "env_error", "running")
"""The trajectory table's outcome filter; `running` is a trajectory with no EpisodeFinished yet."""
CURVE_COLUMNS = ("approx_kl", "clip_frac", "kl_ref", "staleness_mean", "mismatch_k3", "grad_norm", "loss")
"""Per-update statistics drawn as curves by version (the keys of `UpdateApplied.stats`, and columns of
the `updates` view: `mismatch_k3` is the sampler-vs-trainer KL on fresh tokens, `trainer/mismatch.py`)."""


def page_path(run_id: str | None = None, kind: str | None = None, key: str | int | None = None) -> str:
    """The viewer's path of a page: the runs (no argument), a run, or one of its `trajectories`,
    `groups` or `updates`. The one place the viewer's routes and every link to them agree on."""
    if run_id is None:
        return "/"
    path = f"/runs/{quote(run_id, safe='')}"
    return path if kind is None else f"{path}/{kind}/{quote(str(key), safe='')}"


def page_url(viewer_url: str, run_id: str | None = None, kind: str | None = None, key=None) -> str:
    """The absolute URL of a viewer page under `viewer_url` (`StackSettings.viewer_url`)."""
    return viewer_url.rstrip("/") + page_path(run_id, kind, key)


def rows(con: duckdb.DuckDBPyConnection, query: str, params: dict | None = None) -> list[dict]:
    cur = con.execute(query, params or {})
    names = [d[0] for d in cur.description]
    return [dict(zip(names, r)) for r in cur.fetchall()]


def one(con: duckdb.DuckDBPyConnection, query: str, params: dict | None = None) -> dict | None:
    found = rows(con, query, params)
    return found[0] if found else None


def runs(con: duckdb.DuckDBPyConnection) -> list[dict]:
    """Every run, newest first, with its suite, command, versions, episodes and success."""
    return rows(con, "SELECT * FROM runs ORDER BY started_at DESC NULLS LAST, run_id")


def run(con: duckdb.DuckDBPyConnection, run_id: str) -> dict | None:
    return one(con, "SELECT * FROM runs WHERE run_id = $r", {"r": run_id})


def version_curves(con: duckdb.DuckDBPyConnection, run_id: str) -> dict[str, list[tuple[float, float]]]:
    """Series of (policy version, value): training success (`success_by_version`), held-out success
    (`evaluations` of the run's `<run>-eval-*` stages and its own), each update's statistics against the
    version it produced, and environment steps per second while each version was the newest."""
    series: dict[str, list[tuple[float, float]]] = {}
    series["success (training tasks)"] = [
        (r["policy_version"], r["success_rate"])
        for r in rows(
            con,
            "SELECT policy_version, success_rate FROM success_by_version WHERE run_id = $r ORDER BY policy_version",
            {"r": run_id},
        )
    ]
    series["success (held-out)"] = [
        (r["policy_version"], r["success_rate"])
        for r in rows(
            con,
            "SELECT policy_version, success_rate FROM evaluations WHERE run_id = $r AND split <> 'train' "
            "ORDER BY evaluated_at",
            {"r": run_id},
        )
    ]
    updates = rows(
        con,
        "SELECT version_after, loss, grad_norm, clip_frac, staleness_mean, stats['approx_kl'] "
        "AS approx_kl, stats['kl_ref'] AS kl_ref, mismatch_k3 FROM updates WHERE run_id = $r "
        "ORDER BY update_step",
        {"r": run_id},
    )
    for column in CURVE_COLUMNS:
        series[column] = [(u["version_after"], u[column]) for u in updates if u[column] is not None]
    series["env steps / s"] = [
        (r["v"], r["rate"])
        for r in rows(
            con,
            """
        WITH spans AS (
            SELECT version AS v, epoch(lead(published_at) OVER (ORDER BY version) - published_at) AS seconds
            FROM policy_versions WHERE run_id = $r)
        SELECT v, count(s.step) / spans.seconds AS rate
        FROM spans JOIN steps AS s ON s.run_id = $r AND s.policy_version = spans.v
        WHERE spans.seconds > 0 GROUP BY v, spans.seconds ORDER BY v""",
            {"r": run_id},
        )
    ]
    return series


def trajectories(
    con: duckdb.DuckDBPyConnection, run_id: str, outcome: str | None = None, limit: int = 500
) -> list[dict]:
    """The run's trajectories, newest first: outcome, task and template, length, version span, the
    env-error reason and the group advantage. `outcome` filters (`OUTCOMES`; `running`: unfinished)."""
    where = "run_id = $r"
    if outcome == "running":
        where += " AND outcome IS NULL"
    elif outcome:
        where += " AND outcome = $o"
    params = {"r": run_id, "limit": limit} | ({"o": outcome} if outcome and outcome != "running" else {})
    return rows(
        con,
        f"""
        SELECT t.trajectory_id, t.group_id, t.task_id, awrl_task_template(t.task_id) AS template, t.outcome,
               t.reward, t.num_steps, t.min_policy_version, t.max_policy_version, t.env_error_reason,
               t.started_at, a.advantage
        FROM (SELECT * FROM trajectories WHERE {where}) AS t
        LEFT JOIN ({_ADVANTAGES}) AS a USING (trajectory_id)
        ORDER BY t.started_at DESC NULLS LAST, t.trajectory_id LIMIT $limit""",
        params,
    )


_ADVANTAGES = """
    SELECT unnest(trajectory_ids) AS trajectory_id, unnest(advantages) AS advantage, group_id AS adv_group
    FROM groups WHERE run_id = $r"""


def counts(con: duckdb.DuckDBPyConnection, run_id: str) -> dict[str, int]:
    """Trajectories per outcome (`running` for unfinished), for the filter's labels."""
    return {
        (o or "running"): n
        for o, n in con.execute(
            "SELECT outcome, count(*) FROM trajectories WHERE run_id = $r GROUP BY outcome", {"r": run_id}
        ).fetchall()
    }


def groups(con: duckdb.DuckDBPyConnection, run_id: str, limit: int = 200) -> list[dict]:
    return rows(
        con,
        "SELECT group_id, task_id, group_size, rewards, advantages, informative, mean_reward, "
        "min_policy_version, max_policy_version, completed_at FROM groups WHERE run_id = $r "
        "ORDER BY completed_at DESC LIMIT $limit",
        {"r": run_id, "limit": limit},
    )


def updates(con: duckdb.DuckDBPyConnection, run_id: str) -> list[dict]:
    return rows(
        con,
        "SELECT update_step, version_before, version_after, num_groups, num_trajectories, loss, "
        "grad_norm, clip_frac, staleness_mean, duration_s, weights_sha256, applied_at FROM updates "
        "WHERE run_id = $r ORDER BY update_step",
        {"r": run_id},
    )


def trajectory(con: duckdb.DuckDBPyConnection, run_id: str, trajectory_id: str) -> dict | None:
    """One trajectory with its group's advantage for it, and its steps (`browse_steps.sql`)."""
    found = one(
        con,
        f"""
        SELECT t.*, awrl_task_template(t.task_id) AS template, a.advantage
        FROM (SELECT * FROM trajectories WHERE run_id = $r AND trajectory_id = $t) AS t
        LEFT JOIN ({_ADVANTAGES}) AS a USING (trajectory_id)""",
        {"r": run_id, "t": trajectory_id},
    )
    if found is not None:
        found["steps"] = rows(con, load_sql("browse_steps"), {"run_id": run_id, "trajectory_id": trajectory_id})
        found["verdicts"] = rows(
            con,
            "SELECT judge, model, gives_reward, success, reason, error, attempts, latency_s, response_text "
            "FROM verdicts WHERE run_id = $r AND trajectory_id = $t ORDER BY gives_reward DESC, judge, judged_at",
            {"r": run_id, "t": trajectory_id},
        )
    return found


def group(con: duckdb.DuckDBPyConnection, run_id: str, group_id: str) -> dict | None:
    """One group: its rewards and advantages, and its trajectories (successes first)."""
    found = one(con, "SELECT * FROM groups WHERE run_id = $r AND group_id = $g", {"r": run_id, "g": group_id})
    members = rows(
        con,
        f"""
        SELECT t.trajectory_id, t.outcome, t.reward, t.num_steps, t.min_policy_version, t.max_policy_version,
               t.env_error_reason, a.advantage,
               (SELECT screenshot_sha256 FROM steps AS s WHERE s.run_id = $r AND s.trajectory_id = t.trajectory_id
                ORDER BY s.step DESC LIMIT 1) AS last_screenshot
        FROM (SELECT * FROM trajectories WHERE run_id = $r AND group_id = $g) AS t
        LEFT JOIN ({_ADVANTAGES}) AS a USING (trajectory_id)
        ORDER BY t.outcome = 'success' DESC, t.reward DESC NULLS LAST, t.trajectory_id""",
        {"r": run_id, "g": group_id},
    )
    if found is None and not members:
        return None
    return {"group": found, "trajectories": members}


def update(con: duckdb.DuckDBPyConnection, run_id: str, update_step: int) -> dict | None:
    """One `UpdateApplied`: its statistics and weights digest, and the trajectories it trained on."""
    found = one(con, "SELECT * FROM updates WHERE run_id = $r AND update_step = $u", {"r": run_id, "u": update_step})
    if found is None:
        return None
    found["trajectories"] = rows(
        con,
        f"""
        SELECT t.trajectory_id, t.group_id, t.outcome, t.reward, t.num_steps, t.min_policy_version,
               t.max_policy_version, a.advantage
        FROM (SELECT * FROM trajectories WHERE run_id = $r AND list_contains($ids, trajectory_id)) AS t
        LEFT JOIN ({_ADVANTAGES}) AS a USING (trajectory_id)
        ORDER BY t.group_id, a.advantage DESC""",
        {"r": run_id, "ids": list(found["trajectory_ids"])},
    )
    return found
