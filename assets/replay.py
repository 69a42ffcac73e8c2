"""Replay from the UI: a run's recorded updates re-run offline, bit for bit or through a loss variant.

The asset is `analysis.replay` (what `awrl replay` runs) materialized for one run: one row per optimizer
step, the recorded config's replay beside the recording and the variant's statistics beside both. It is
launched by a person (Materialize, with the variant in the launch config), never by the sensor: a
replay loads the model and re-runs every update, minutes where the tables take seconds.

No `from __future__ import annotations` here: Dagster reads the config annotations at definition time.
"""

import json

import dagster as dg
import pyarrow as pa

from assets.io import Ledger
from assets.partitions import runs
from assets.tables import output, plot_md
from pipeline.settings import MissingSettings


class ReplayConfig(dg.Config):
    """What to replay, as `awrl replay` takes it."""

    variant: str = ""
    """A named loss variant (`analysis.replay.VARIANTS`: per_trajectory, 1/k, token, raft, tight-clip,
    no-dual-clip); empty: the recorded config only, to check that it replays bit for bit."""
    overrides: list[str] = []
    """Further config overrides, `KEY=VALUE` with dotted keys and JSON values (`ppo.eps_high=0.3`)."""
    updates: str = ""
    """Update steps `A..B` (inclusive) or `A`; empty: every recorded update."""


SCHEMA = pa.schema(
    [
        ("update_step", pa.int64()),
        ("version_before", pa.int64()),
        ("exact", pa.bool_()),
        ("loss_recorded", pa.float64()),
        ("loss_replayed", pa.float64()),
        ("loss_variant", pa.float64()),
        ("grad_norm_recorded", pa.float64()),
        ("grad_norm_replayed", pa.float64()),
        ("grad_norm_variant", pa.float64()),
        ("weights_sha256_recorded", pa.string()),
        ("weights_sha256_replayed", pa.string()),
        ("stats_replayed", pa.map_(pa.string(), pa.float64())),
        ("stats_variant", pa.map_(pa.string(), pa.float64())),
        ("kl_recorded_variant", pa.float64()),
    ]
)
"""One row per optimizer step; the variant's columns are NULL when no variant was named."""


@dg.asset(
    partitions_def=runs,
    group_name="training",
    kinds={"pytorch", "parquet"},
    deps=["update_applied", "step_recorded", "group_completed", "policy_version_published"],
)
def replay(context: dg.AssetExecutionContext, config: ReplayConfig, ledger: Ledger) -> dg.Output[pa.Table]:
    """The run's recorded updates re-run from the ledger and the stored checkpoints, without a browser
    or a broker (`analysis.replay`): bit-exact or not per update and, with a variant, its loss,
    gradient norm, statistics and KL to the recorded config's result, update by update."""
    from analysis.replay import RunLedger, parse_overrides, update_range
    from analysis.replay import replay as run_replay

    try:
        overrides = parse_overrides(config.variant or None, config.overrides)
        selection = update_range(config.updates) if config.updates else None
    except (KeyError, ValueError) as exc:
        raise dg.Failure(description=str(exc)) from None
    try:
        why = RunLedger(ledger.settings(), context.partition_key).unreplayable()
    except MissingSettings as exc:  # no object store configured: nothing to load checkpoints from
        why = str(exc)
    if why:
        # "Materialize all" reaches every run, sample and foreign ledgers too: say why, fail the check
        context.log.warning(f"{context.partition_key} cannot be replayed: {why}")
        return output(SCHEMA.empty_table(), variant=config.variant or "(recorded config only)", not_replayed=why)
    results = run_replay(
        ledger.settings(),
        context.partition_key,
        overrides or None,
        selection,
        on_batch=lambda i, n, _: context.log.info(f"replayed batch {i}/{n}"),
    )
    rows = [
        {
            "update_step": s.update_step,
            "version_before": b.version_before,
            "exact": b.exact,
            "loss_recorded": u.loss,
            "loss_replayed": s.loss,
            "loss_variant": v and v.loss,
            "grad_norm_recorded": u.grad_norm,
            "grad_norm_replayed": s.grad_norm,
            "grad_norm_variant": v and v.grad_norm,
            "weights_sha256_recorded": u.weights_sha256,
            "weights_sha256_replayed": s.weights_sha256,
            "stats_replayed": s.stats,
            "stats_variant": v and v.stats,
            "kl_recorded_variant": b.kl,
        }
        for b in results
        for s, u, v in zip(b.same, b.recorded, b.variant or [None] * len(b.same), strict=True)
    ]
    table = pa.Table.from_pylist(rows, schema=SCHEMA)
    metadata: dict = {
        "variant": config.variant or "(recorded config only)",
        "overrides": dg.MetadataValue.json(overrides),
        "batches": len(results),
        "batches_exact": sum(b.exact for b in results),
    }
    if rows:
        losses = {"recorded": [r["loss_recorded"] for r in rows], "replayed": [r["loss_replayed"] for r in rows]}
        if overrides:
            losses["variant"] = [r["loss_variant"] for r in rows]
        metadata["loss_curve"] = plot_md("loss per update", [r["update_step"] for r in rows], losses, "update step")
    context.log.info(
        f"replay of {context.partition_key}: {json.dumps(metadata['overrides'].data)}, "
        f"{metadata['batches_exact']}/{len(results)} batches bit-exact"
    )
    return output(table, **metadata)


@dg.asset_check(asset=replay)
def replay_bit_exact(replay: pa.Table) -> dg.AssetCheckResult:
    """The recorded config replays bit for bit (loss, gradient norm, weights' sha256): the premise that
    makes a variant's difference the variant's, not noise. See `analysis.replay` for the conditions.
    A run that could not be replayed (no table rows) fails it as a warning."""
    bad = [r["update_step"] for r in replay.select(["update_step", "exact"]).to_pylist() if not r["exact"]]
    return dg.AssetCheckResult(
        passed=bool(replay.num_rows) and not bad,
        severity=dg.AssetCheckSeverity.ERROR if replay.num_rows else dg.AssetCheckSeverity.WARN,
        metadata={"updates": replay.num_rows, "not_exact": dg.MetadataValue.json(bad)},
    )
