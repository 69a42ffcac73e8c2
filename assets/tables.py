"""One asset per ledger table, each a partition per training run (`runs`, filled by the sensor).

The tables are the SQL views of `analysis/sql/`, materialized for one run: the view is the one
definition, so the Dagster UI, `awrl sql` and every analysis show the same rows and columns. Each asset
declares the event tables (`assets.events`) or assets it reads, so the graph starts at the events.
Every asset is a fold over the run's immutable events, so re-materialising a partition after more events
arrived just recomputes it; nothing here is a source of truth. Row counts go to `dagster/row_count`,
columns to `dagster/column_schema`; curves are PNGs embedded in Markdown metadata, so the Dagster UI
shows them without extra services.

No `from __future__ import annotations` here: Dagster reads the context and resource annotations
at definition time and rejects them as strings.
"""

import base64
import dataclasses
import io

import dagster as dg
import pyarrow as pa

from analysis.browse import page_url
from analysis.curves import evaluation_points, success_by_version
from analysis.drift import DriftReport, drift_metrics
from analysis.views import connect
from assets.events import table_schema
from assets.io import Ledger, run_query
from assets.partitions import runs

VIEW_KINDS = {"duckdb", "parquet"}


def plot_md(title: str, x: list, ys: dict[str, list], xlabel: str, ylim=None) -> dg.MetadataValue:
    """A small line plot as Markdown with an inline PNG (renders in the asset's metadata panel)."""
    from matplotlib.figure import Figure  # Agg canvas, no pyplot global state: safe in any thread

    fig = Figure(figsize=(6, 2.8), dpi=80)
    ax = fig.subplots()
    for label, y in ys.items():
        ax.plot(x, y, marker=".", label=label)
    ax.set(title=title, xlabel=xlabel, ylim=ylim)
    ax.grid(alpha=0.3)
    if len(ys) > 1:
        ax.legend()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    return dg.MetadataValue.md(f"![{title}](data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()})")


def view_rows(ledger: Ledger, run: str, view: str, order: str) -> pa.Table:
    """The rows of the view `analysis/sql/<view>.sql` for one run: the table's one definition."""
    with connect(ledger.settings(), run_id=run) as con:
        return con.sql(
            f"select * from {view} where run_id = $run order by {order}", params={"run": run}
        ).to_arrow_table()


def output(table: pa.Table, **metadata) -> dg.Output[pa.Table]:
    return dg.Output(
        table,
        metadata={"dagster/row_count": table.num_rows, "dagster/column_schema": table_schema(table.schema), **metadata},
    )


@dg.asset(partitions_def=runs, group_name="trajectories", kinds=VIEW_KINDS, deps=["step_recorded"])
def steps(context: dg.AssetExecutionContext, ledger: Ledger) -> dg.Output[pa.Table]:
    """One row per agent step (view `steps`): its action, memory, versions and timings. The token
    arrays stay in the ledger (~10 KB a step, the trainer's input): here they are counts and version
    ranges, because an in-place weight refresh can land in the middle of a step."""
    table = view_rows(ledger, context.partition_key, "steps", "trajectory_id, step")
    return output(
        table,
        trajectories=len(set(table.column("trajectory_id").to_pylist())),
        step_errors=table.num_rows - table.column("error_class").null_count,
    )


@dg.asset(
    partitions_def=runs,
    group_name="trajectories",
    kinds=VIEW_KINDS,
    deps=["episode_started", "episode_finished", "step_recorded"],
)
def trajectories(context: dg.AssetExecutionContext, ledger: Ledger) -> dg.Output[pa.Table]:
    """One row per episode (view `trajectories`): length, outcome (NULL while running), tokens and
    the policy versions it spanned (async rollout lets one trajectory carry several). The env-error
    reason is kept apart so broken environments are not mistaken for policy failures."""
    table = view_rows(ledger, context.partition_key, "trajectories", "started_at nulls last, trajectory_id")
    n = table.num_rows - table.column("finished_at").null_count
    window = max(1, min(32, n // 4))
    curve = (
        run_query(
            f"""select avg((outcome = 'success')::int)
                            over (order by finished_at rows {window - 1} preceding) as r
                          from t where finished_at is not null order by finished_at""",
            t=table,
        )
        .column("r")
        .to_pylist()
    )
    metadata = {"finished": n, "success_rate": table.column("outcome").to_pylist().count("success") / n if n else 0.0}
    if n:
        metadata["success_rate_curve"] = plot_md(
            f"success rate (rolling {window})",
            list(range(1, n + 1)),
            {"success rate": curve},
            "trajectories finished",
            (-0.05, 1.05),
        )
    metadata["viewer"] = dg.MetadataValue.url(page_url(ledger.settings().viewer_url, context.partition_key))
    return output(table, **metadata)


@dg.asset(partitions_def=runs, group_name="trajectories", kinds=VIEW_KINDS, deps=["group_completed"])
def groups(context: dg.AssetExecutionContext, ledger: Ledger) -> dg.Output[pa.Table]:
    """One row per completed GRPO group (view `groups`) with its advantages, computed by
    `trainer.advantages`: the very function the trainer's batch builder calls, so this table shows
    exactly what was trained on. `informative` is False where all rewards are equal (dynamic sampling
    drops those groups)."""
    table = view_rows(ledger, context.partition_key, "groups", "completed_at, group_id")
    kept = sum(table.column("informative").to_pylist())
    return output(table, informative=kept, informative_fraction=kept / table.num_rows if table.num_rows else 0.0)


@dg.asset(partitions_def=runs, group_name="training", kinds=VIEW_KINDS, deps=["policy_version_published"])
def policy_versions(context: dg.AssetExecutionContext, ledger: Ledger) -> dg.Output[pa.Table]:
    """Each published checkpoint (view `policy_versions`) and how long after the previous one it came:
    the refresh cadence that, with rollout speed, sets how stale the trajectories the trainer consumes are."""
    table = view_rows(ledger, context.partition_key, "policy_versions", "version")
    return output(table, latest_version=max(table.column("version").to_pylist(), default=None))


@dg.asset(partitions_def=runs, group_name="training", kinds=VIEW_KINDS, deps=["update_applied"])
def updates(context: dg.AssetExecutionContext, ledger: Ledger) -> dg.Output[pa.Table]:
    """One row per optimizer step (view `updates`) with its loss statistics, batch, config and the
    largest rank's memory: what replay needs to re-run it."""
    table = view_rows(ledger, context.partition_key, "updates", "update_step")
    metadata = {}
    if table.num_rows:
        metadata["loss_curve"] = plot_md(
            "loss", table.column("update_step").to_pylist(), {"loss": table.column("loss").to_pylist()}, "update step"
        )
        last = max(table.column("update_step").to_pylist())  # its page links to the trajectories it trained on
        metadata["viewer"] = dg.MetadataValue.url(
            page_url(ledger.settings().viewer_url, context.partition_key, "updates", last)
        )
    return output(table, **metadata)


@dg.asset(partitions_def=runs, group_name="analysis", kinds=VIEW_KINDS)
def throughput(steps: pa.Table, trajectories: pa.Table) -> dg.Output[pa.Table]:
    """Steps/s and finished trajectories/hour per minute of the run, and over the whole run: the
    system-side numbers asynchronous rollout exists to raise."""
    table = run_query(
        """
        with s as (select date_trunc('minute', emitted_at) as minute, count(*) as n from steps group by 1),
             t as (select date_trunc('minute', finished_at) as minute, count(*) as n from trajectories
                   where finished_at is not null group by 1)
        select minute, coalesce(s.n, 0) as steps, coalesce(t.n, 0) as trajectories_finished,
               coalesce(s.n, 0) / 60.0 as steps_per_s, coalesce(t.n, 0) * 60::double as trajectories_per_hour
        from s full join t using (minute) order by minute""",
        steps=steps,
        trajectories=trajectories,
    )
    overall = run_query(
        """
        select count(*) as steps, epoch(max(emitted_at) - min(emitted_at)) as seconds,
               (select count(finished_at) from trajectories) as finished from steps""",
        steps=steps,
        trajectories=trajectories,
    ).to_pylist()[0]
    seconds = overall["seconds"] or 0.0
    return output(
        table,
        run_seconds=seconds,
        steps_per_s=overall["steps"] / seconds if seconds else 0.0,
        trajectories_per_hour=overall["finished"] * 3600 / seconds if seconds else 0.0,
    )


@dg.asset(
    partitions_def=runs,
    group_name="analysis",
    kinds=VIEW_KINDS,
    deps=["trajectories", "episode_started", "evaluation_completed"],
)
def learning_curve(context: dg.AssetExecutionContext, ledger: Ledger) -> dg.Output[pa.Table]:
    """Success on the run's training tasks per policy version, with its 95% Wilson interval: the
    `success_by_version` view, so this table, `awrl report`'s plot and `awrl sql` agree. The held-out
    half of the curve is the run's `EvaluationCompleted` events (`evaluations` view); its count is noted."""
    with connect(ledger.settings(), run_id=context.partition_key) as con:
        table = success_by_version(con, context.partition_key)
        evaluations = len(evaluation_points(con, context.partition_key))
    metadata: dict = {"evaluations": evaluations}
    if table.num_rows:
        t = table.to_pydict()
        metadata["success_by_version_curve"] = plot_md(
            "training-task success (95% Wilson)",
            t["policy_version"],
            {"success rate": t["success_rate"], "95% low": t["ci95_low"], "95% high": t["ci95_high"]},
            "policy version",
            (-0.05, 1.05),
        )
    return output(table, **metadata)


_DRIFT_TYPES = {
    "str": pa.string(),
    "int": pa.int64(),
    "int | None": pa.int64(),
    "float | None": pa.float64(),
    "keys_by_step": pa.list_(
        pa.struct([("step", pa.int64()), ("steps", pa.int64()), ("mean_keys", pa.float64()), ("max_keys", pa.int64())])
    ),
    "clip_rate_by_update": pa.list_(pa.struct([("update_step", pa.int64()), ("clip_rate", pa.float64())])),
}
"""Arrow types of `DriftReport` fields (by name, else by annotation), so a run whose metric is still None
or whose curve is empty has the same schema as every other partition."""


@dg.asset(partitions_def=runs, group_name="analysis", kinds=VIEW_KINDS, deps=["steps", "trajectories", "updates"])
def memory_drift(context: dg.AssetExecutionContext, ledger: Ledger) -> dg.Output[pa.Table]:
    """The paper's length-coupled memory drift of one run (`analysis.drift`, AsyncWebRL, arXiv 2606.05597): one row of
    metrics with its curves nested, so runs trained with 1/|tau| and 1/k compare side by side across
    partitions. The keys-per-step curve is the picture of the drift: ~1 key per step under 1/|tau|."""
    run = context.partition_key
    report = drift_metrics(connect(ledger.settings(), run_id=run), run).to_dict()
    schema = pa.schema(
        [(f.name, _DRIFT_TYPES.get(f.name) or _DRIFT_TYPES[f.type]) for f in dataclasses.fields(DriftReport)]
    )
    table = pa.Table.from_pylist([report], schema=schema)
    metadata: dict = {
        k: report[k]
        for k in (
            "generic_key_ratio",
            "first_last_stable_ratio",
            "adjacent_unchanged_ratio",
            "keys_per_step_slope",
            "length_downweight",
            "offpolicy_gap_mean",
            "clip_rate_mean",
        )
    }
    if curve := report["keys_by_step"]:
        metadata["keys_by_step_curve"] = plot_md(
            "memory keys by step",
            [r["step"] for r in curve],
            {"mean keys": [r["mean_keys"] for r in curve], "max keys": [r["max_keys"] for r in curve]},
            "step",
        )
    if clip := report["clip_rate_by_update"]:
        metadata["clip_rate_curve"] = plot_md(
            "clip rate", [r["update_step"] for r in clip], {"clip rate": [r["clip_rate"] for r in clip]}, "update step"
        )
    return output(table, **metadata)
