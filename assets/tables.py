"""One asset per ledger table, each a partition per training run (`runs`, filled by the sensor).

Every asset is a fold over the run's immutable events, so re-materialising a partition after more events
arrived just recomputes it; nothing here is a source of truth. Row counts go to `dagster/row_count`;
curves are PNGs embedded in Markdown metadata, so the Dagster UI shows them without extra services.

No `from __future__ import annotations` here: Dagster reads the context and resource annotations
at definition time and rejects them as strings.
"""

import base64
import dataclasses
import io

import dagster as dg
import pyarrow as pa

from analysis.curves import evaluation_points, success_by_version
from analysis.drift import DriftReport, drift_metrics
from analysis.ledger import connect
from assets.io import Ledger, sql
from trainer.advantages import group_advantages, informative

runs = dg.DynamicPartitionsDefinition(name="runs")
"""One partition per `run_id` found in the ledger."""


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


@dg.asset(partitions_def=runs)
def steps(context: dg.AssetExecutionContext, ledger: Ledger) -> dg.Output[pa.Table]:
    """One row per agent step, without the token arrays (~10 KB a step, the trainer's input: they stay in
    the ledger). Tokens become counts, and the range of policy versions that produced them, because an
    in-place weight refresh can land in the middle of a step."""
    events = ledger.events(context.partition_key, "StepRecorded", columns=[
        "trajectory_id", "group_id", "task_id", "step", "policy_version", "token_policy_versions",
        "response_token_ids", "prompt_token_ids", "action", "url", "memory", "error_class", "timings",
        "emitted_at"])
    table = sql("""
        select trajectory_id, group_id, task_id, step, policy_version,
               least(policy_version, list_min(token_policy_versions)) as min_version,
               greatest(policy_version, list_max(token_policy_versions)) as max_version,
               len(response_token_ids) as response_tokens, len(prompt_token_ids) as prompt_tokens,
               action.kind as action, url, cardinality(memory)::bigint as memory_keys, error_class,
               timings.policy_s, timings.browser_s, timings.wait_s, emitted_at
        from e order by trajectory_id, step""", e=events)
    return dg.Output(table, metadata={
        "dagster/row_count": table.num_rows,
        "trajectories": len(set(table.column("trajectory_id").to_pylist())),
        "step_errors": table.num_rows - table.column("error_class").null_count,
    })


@dg.asset(partitions_def=runs)
def trajectories(context: dg.AssetExecutionContext, ledger: Ledger, steps: pa.Table) -> dg.Output[pa.Table]:
    """One row per episode: length, outcome, tokens and the policy versions it spanned (async rollout lets
    one trajectory carry several). Episodes still running have outcome `running`; the env-error reason
    is kept apart so broken environments are not mistaken for policy failures."""
    run = context.partition_key
    started = ledger.events(run, "EpisodeStarted", columns=[
        "trajectory_id", "group_id", "task_id", "worker_id", "horizon", "policy_version", "emitted_at"])
    finished = ledger.events(run, "EpisodeFinished", columns=[
        "trajectory_id", "outcome", "reward", "num_steps", "reason", "emitted_at"])
    table = sql("""
        with s as (select trajectory_id, count(*) n, sum(response_tokens)::bigint rt, sum(prompt_tokens)::bigint pt,
                          min(min_version) lo, max(max_version) hi, count(error_class) errors
                   from steps group by trajectory_id)
        select b.trajectory_id, b.group_id, b.task_id, b.worker_id, b.horizon,
               coalesce(f.outcome, 'running') as outcome, f.reward, coalesce(f.num_steps, s.n, 0) as length,
               coalesce(s.rt, 0) as response_tokens, coalesce(s.pt, 0) as prompt_tokens,
               least(b.policy_version, s.lo) as min_policy_version,
               greatest(b.policy_version, s.hi) as max_policy_version,
               case when f.outcome = 'env_error' then f.reason end as env_error_reason,
               coalesce(s.errors, 0) as step_errors, b.emitted_at as started_at, f.emitted_at as finished_at
        from b left join f using (trajectory_id) left join s using (trajectory_id)
        order by started_at, trajectory_id""", b=started, f=finished, steps=steps)
    n = table.num_rows - table.column("finished_at").null_count
    window = max(1, min(32, n // 4))
    curve = sql(f"""select avg((outcome = 'success')::int) over (order by finished_at rows {window - 1} preceding) as r
                    from t where finished_at is not null order by finished_at""", t=table).column("r").to_pylist()
    metadata = {"dagster/row_count": table.num_rows, "finished": n,
                "success_rate": table.column("outcome").to_pylist().count("success") / n if n else 0.0}
    if n:
        metadata["success_rate_curve"] = plot_md(f"success rate (rolling {window})", list(range(1, n + 1)),
                                                 {"success rate": curve}, "trajectories finished", (-0.05, 1.05))
    return dg.Output(table, metadata=metadata)


@dg.asset(partitions_def=runs)
def groups(context: dg.AssetExecutionContext, ledger: Ledger) -> dg.Output[pa.Table]:
    """One row per completed GRPO group with its advantages, computed by `trainer.advantages`: the very
    function the trainer's batch builder calls, so this table shows exactly what was trained on.
    `informative` is False where all rewards are equal (dynamic sampling drops those groups)."""
    table = ledger.events(context.partition_key, "GroupCompleted", columns=[
        "group_id", "task_id", "trajectory_ids", "rewards", "num_steps", "outcomes",
        "min_policy_version", "max_policy_version", "emitted_at"]).sort_by("emitted_at")
    rewards = table.column("rewards").to_pylist()
    table = (table.append_column("advantages", pa.array([group_advantages(r) for r in rewards], pa.list_(pa.float64())))
             .append_column("informative", pa.array([informative(r) for r in rewards], pa.bool_()))
             .rename_columns({"emitted_at": "completed_at"}))
    kept = sum(table.column("informative").to_pylist())
    return dg.Output(table, metadata={
        "dagster/row_count": table.num_rows,
        "informative": kept,
        "informative_fraction": kept / table.num_rows if table.num_rows else 0.0,
    })


@dg.asset(partitions_def=runs)
def policy_versions(context: dg.AssetExecutionContext, ledger: Ledger) -> dg.Output[pa.Table]:
    """Each published checkpoint and how long after the previous one it came: the refresh cadence that,
    with rollout speed, sets how stale the trajectories the trainer consumes are."""
    events = ledger.events(context.partition_key, "PolicyVersionPublished", columns=[
        "version", "update_step", "parent_version", "update_ids", "checkpoint_uri", "checkpoint_sha256",
        "publish_s", "emitted_at"])
    table = sql("""
        select version, parent_version, update_step, update_ids, checkpoint_uri, checkpoint_sha256, publish_s,
               emitted_at as published_at,
               epoch(emitted_at - lag(emitted_at) over (order by version)) as seconds_since_previous
        from e order by version""", e=events)
    latest = max(table.column("version").to_pylist(), default=None)
    return dg.Output(table, metadata={"dagster/row_count": table.num_rows, "latest_version": latest})


@dg.asset(partitions_def=runs)
def updates(context: dg.AssetExecutionContext, ledger: Ledger) -> dg.Output[pa.Table]:
    """One row per optimizer step with its loss statistics; the batch's ids become counts here (the
    ledger keeps them, with the config, for replay)."""
    events = ledger.events(context.partition_key, "UpdateApplied", columns=[
        "update_step", "version_before", "version_after", "group_ids", "trajectory_ids", "loss",
        "grad_norm", "stats", "duration_s", "wait_s", "compute_s", "world_size", "memory", "weights_sha256",
        "emitted_at"])
    # per-rank memory (schema 4 on): the largest rank's peak and sharded state, null for older events
    table = sql("""
        select update_step, version_before, version_after, len(group_ids) as groups,
               len(trajectory_ids) as trajectories, loss, grad_norm, stats, duration_s, wait_s, compute_s,
               world_size, list_max(list_transform(memory, lambda m: m.peak_bytes)) as peak_bytes_max_rank,
               list_max(list_transform(memory, lambda m: m.params_bytes + m.grads_bytes + m.optimizer_bytes))
                   as state_bytes_max_rank,
               weights_sha256, emitted_at as applied_at
        from e order by update_step""", e=events)
    metadata: dict = {"dagster/row_count": table.num_rows}
    if table.num_rows:
        metadata["loss_curve"] = plot_md("loss", table.column("update_step").to_pylist(),
                                         {"loss": table.column("loss").to_pylist()}, "update step")
    return dg.Output(table, metadata=metadata)


@dg.asset(partitions_def=runs)
def throughput(steps: pa.Table, trajectories: pa.Table) -> dg.Output[pa.Table]:
    """Steps/s and finished trajectories/hour per minute of the run, and over the whole run: the
    system-side numbers asynchronous rollout exists to raise."""
    table = sql("""
        with s as (select date_trunc('minute', emitted_at) as minute, count(*) as n from steps group by 1),
             t as (select date_trunc('minute', finished_at) as minute, count(*) as n from trajectories
                   where finished_at is not null group by 1)
        select minute, coalesce(s.n, 0) as steps, coalesce(t.n, 0) as trajectories_finished,
               coalesce(s.n, 0) / 60.0 as steps_per_s, coalesce(t.n, 0) * 60::double as trajectories_per_hour
        from s full join t using (minute) order by minute""", steps=steps, trajectories=trajectories)
    overall = sql("""
        select count(*) as steps, epoch(max(emitted_at) - min(emitted_at)) as seconds,
               (select count(finished_at) from trajectories) as finished from steps""",
                  steps=steps, trajectories=trajectories).to_pylist()[0]
    seconds = overall["seconds"] or 0.0
    return dg.Output(table, metadata={
        "dagster/row_count": table.num_rows,
        "run_seconds": seconds,
        "steps_per_s": overall["steps"] / seconds if seconds else 0.0,
        "trajectories_per_hour": overall["finished"] * 3600 / seconds if seconds else 0.0,
    })


@dg.asset(partitions_def=runs)
def learning_curve(context: dg.AssetExecutionContext, ledger: Ledger) -> dg.Output[pa.Table]:
    """Success on the run's training tasks per policy version, with its 95% Wilson interval: the
    `success_by_version` view, so this table, `awrl report`'s plot and `awrl sql` agree. The held-out
    half of the curve is the run's `EvaluationCompleted` events (`evaluations` view); its count is noted."""
    with connect(ledger.settings()) as con:
        table = success_by_version(con, context.partition_key)
        evaluations = len(evaluation_points(con, context.partition_key))
    metadata: dict = {"dagster/row_count": table.num_rows, "evaluations": evaluations}
    if table.num_rows:
        t = table.to_pydict()
        metadata["success_by_version_curve"] = plot_md(
            "training-task success (95% Wilson)", t["policy_version"],
            {"success rate": t["success_rate"], "95% low": t["ci95_low"], "95% high": t["ci95_high"]},
            "policy version", (-0.05, 1.05))
    return dg.Output(table, metadata=metadata)


_DRIFT_TYPES = {
    "str": pa.string(), "int": pa.int64(), "int | None": pa.int64(), "float | None": pa.float64(),
    "keys_by_step": pa.list_(pa.struct([("step", pa.int64()), ("steps", pa.int64()), ("mean_keys", pa.float64()),
                                        ("max_keys", pa.int64())])),
    "clip_rate_by_update": pa.list_(pa.struct([("update_step", pa.int64()), ("clip_rate", pa.float64())])),
}
"""Arrow types of `DriftReport` fields (by name, else by annotation), so a run whose metric is still None
or whose curve is empty has the same schema as every other partition."""


@dg.asset(partitions_def=runs)
def memory_drift(context: dg.AssetExecutionContext, ledger: Ledger) -> dg.Output[pa.Table]:
    """The paper's length-coupled memory drift of one run (`analysis.drift`, AsyncWebRL, arXiv 2606.05597): one row of
    metrics with its curves nested, so runs trained with 1/|tau| and 1/k compare side by side across
    partitions. The keys-per-step curve is the picture of the drift: ~1 key per step under 1/|tau|."""
    report = drift_metrics(connect(ledger.settings()), context.partition_key).to_dict()
    schema = pa.schema([(f.name, _DRIFT_TYPES.get(f.name) or _DRIFT_TYPES[f.type])
                        for f in dataclasses.fields(DriftReport)])
    table = pa.Table.from_pylist([report], schema=schema)
    metadata: dict = {"dagster/row_count": table.num_rows}
    metadata |= {k: report[k] for k in ("generic_key_ratio", "first_last_stable_ratio", "adjacent_unchanged_ratio",
                                         "keys_per_step_slope", "length_downweight", "offpolicy_gap_mean",
                                         "clip_rate_mean")}
    if curve := report["keys_by_step"]:
        metadata["keys_by_step_curve"] = plot_md(
            "memory keys by step", [r["step"] for r in curve],
            {"mean keys": [r["mean_keys"] for r in curve], "max keys": [r["max_keys"] for r in curve]}, "step")
    if clip := report["clip_rate_by_update"]:
        metadata["clip_rate_curve"] = plot_md("clip rate", [r["update_step"] for r in clip],
                                              {"clip rate": [r["clip_rate"] for r in clip]}, "update step")
    return dg.Output(table, metadata=metadata)
