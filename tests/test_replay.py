"""Replay on the real stack: a short recorded run (2 trainer processes, a KL penalty and the SFT
anchor) is re-run offline from the ledger and the object store, bit for bit, and through loss variants
whose per-token weights on the known batch are worked out by hand."""

from __future__ import annotations

import math
import uuid

import pytest

from analysis.replay import VARIANTS, replay, with_overrides
from pipeline.ledger import LedgerWriter
from trainer.config import AnchorConfig, TrainConfig
from trainer.launch import launch

from test_train_resume import publish_groups

slow = pytest.mark.slow  # everything using the recorded run: a torchrun trainer on the real stack


@pytest.fixture(scope="module")
def recorded(module_settings, tmp_path_factory):
    """Run `rp-*`: 2 updates of one group each (two one-step trajectories, rewards 1 and 0), 2 processes,
    with a KL penalty to version 0 (so replay must rebuild pi_ref too) and the SFT anchor on the run's
    own 2 successful steps, one drawn a step (so one rank runs a padding demonstration, and replay must
    read the demonstrations from the ledger and draw the same one)."""
    import os

    from pipeline.bus import create_topics

    settings = module_settings.model_copy(
        update={"topic_prefix": f"t{uuid.uuid4().hex[:8]}", "ledger_uri": str(tmp_path_factory.mktemp("ledger"))}
    )
    create_topics(settings)
    run_id = f"rp-{uuid.uuid4().hex[:6]}"
    publish_groups(settings, run_id, 2)
    LedgerWriter(settings).sync(idle_exit_s=3.0)  # the anchor's demonstrations are read from the ledger
    config = TrainConfig(
        run_id=run_id,
        groups_per_update=1,
        max_updates=2,
        batch_timeout_s=30,
        kl_coef=0.5,
        anchor=AnchorConfig(coef=0.5, run_ids=(run_id,), steps=1),
    )
    assert launch(config, nproc=2, env={**os.environ, **settings.environ()}) == 0
    LedgerWriter(settings).sync(idle_exit_s=3.0)
    return settings, run_id


@slow
@pytest.mark.timeout(900)
def test_replay_of_the_recorded_config_is_bit_exact(recorded):
    settings, run_id = recorded
    results = replay(settings, run_id)
    assert [b.version_before for b in results] == [0, 1]
    for b in results:
        (u,), (r,) = b.recorded, b.same
        assert u.world_size == 2 and u.stats["threads"] == 1
        # each FSDP2 rank holds half the weights and gradients, and AdamW's two moments of its half
        assert [m.rank for m in u.memory] == [0, 1] and {m.device for m in u.memory} == {"cpu"}
        assert abs(u.memory[0].params_bytes - u.memory[1].params_bytes) < 0.01 * u.memory[0].params_bytes
        for m in u.memory:
            assert m.grads_bytes == m.params_bytes and 2 * m.params_bytes <= m.optimizer_bytes < 2.01 * m.params_bytes
            assert m.peak_bytes > m.params_bytes
        assert (r.loss, r.grad_norm, r.weights_sha256) == (u.loss, u.grad_norm, u.weights_sha256)
        assert b.exact
        assert (u.stats["kl_ref"] > 0) == (b.version_before > 0)  # at v0 pi_theta is pi_ref
        # the anchor: recorded in the config and the stats, the same demonstration drawn and scored again
        assert TrainConfig.model_validate_json(u.config_json).anchor.coef == 0.5
        assert u.stats["anchor_demonstrations"] == 2 and u.stats["anchor_nll"] > 0
        assert r.stats["anchor_nll"] == u.stats["anchor_nll"]


@slow
@pytest.mark.timeout(900)
def test_replay_without_the_anchor_moves_the_weights_otherwise(recorded):
    settings, run_id = recorded
    (b,) = replay(settings, run_id, {"anchor.coef": 0.0}, updates=range(1, 2), heldout_steps=2)
    (u,), (same,), (v,) = b.recorded, b.same, b.variant
    assert b.exact and "anchor_nll" in same.stats and "anchor_nll" not in v.stats
    assert v.loss == u.loss  # the policy loss alone is the same; the anchor's gradient is not in the step
    assert v.weights_sha256 != u.weights_sha256 and b.kl > 0


@slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "variant, failure, success",
    [
        ("per_trajectory", 0.5, 0.5),  # N_i = 1/|tau_i| = 1; each step's tokens share 1/(B=2)
        ("1/k", 0.05, 0.05),  # N_i = 1/k = 1/10, over B = 2 trajectories
        ("token", None, None),  # 1/(B * 1280) per token: response length / 2560
    ],
)
def test_variant_weights_match_hand_computed_values(recorded, variant, failure, success):
    settings, run_id = recorded
    (b,) = replay(settings, run_id, VARIANTS[variant], updates=range(1, 2), heldout_steps=2)
    (u,), (v,) = b.recorded, b.variant
    if variant == "token":
        steps = {s.trajectory_id: len(s.response_token_ids) for s in _steps(settings, run_id, u.trajectory_ids)}
        succ, fail = (steps[t] for t in u.trajectory_ids)  # rewards 1, 0 in that order
        failure, success = fail / 2560, succ / 2560
    assert math.isclose(v.stats["weight_mass_failure"], failure, rel_tol=1e-6)
    assert math.isclose(v.stats["weight_mass_success"], success, rel_tol=1e-6)
    assert b.kl is not None and b.kl >= 0
    if variant != "1/k":  # the run itself used 1/k (the default): any other weighting moves the weights
        assert v.weights_sha256 != u.weights_sha256 and b.kl > 0


def test_overrides_are_validated():
    config = TrainConfig(run_id="r")
    assert with_overrides(config, {"grpo.normalizer": "token", "lr": 0.5}).grpo.normalizer == "token"
    with pytest.raises(KeyError, match="no config field 'grpo.nope'"):
        with_overrides(config, {"grpo.nope": 1})
    with pytest.raises(ValueError):
        with_overrides(config, {"loss": "sft"})
    with pytest.raises(KeyError, match="awrl rebatch"):
        with_overrides(config, {"eta": 0})


def _steps(settings, run_id, trajectory_ids):
    from pipeline.ledger import read_events
    from schemas import StepRecorded, table_to_events

    steps = table_to_events(read_events(settings, run_id, "StepRecorded"), StepRecorded)
    return [s for s in steps if s.trajectory_id in trajectory_ids]


@slow
@pytest.mark.timeout(900)
def test_replay_cli_writes_the_side_by_side_report(recorded, tmp_path):
    import json

    import typer
    from typer.testing import CliRunner

    from app.analysis_cli import register

    settings, run_id = recorded
    app = typer.Typer()
    register(app)
    env = settings.environ()
    res = CliRunner().invoke(
        app,
        [
            "replay",
            run_id,
            "--variant",
            "per_trajectory",
            "--updates",
            "0..0",
            "--format",
            "json",
            "--out",
            str(tmp_path),
        ],
        env=env,
    )
    assert res.exit_code == 0, res.output
    (batch,) = json.loads(res.stdout)
    assert batch["exact"] and batch["variant"][0]["stats"]["weight_mass_failure"] == pytest.approx(0.5)
    report = (tmp_path / "replay.md").read_text()
    assert "Bit-exact replay of the recorded config: 1/1 batches." in report and (tmp_path / "replay.png").exists()
    res = CliRunner().invoke(app, ["replay", run_id, "--variant", "nope"], env=env)
    assert res.exit_code == 2 and "unknown variant" in res.output


def _materialized(settings, run_id: str):
    import pyarrow.parquet as pq

    return pq.read_table(f"{settings.ledger_uri}/assets/replay/run_id={run_id}/data.parquet").to_pylist()


@slow
@pytest.mark.timeout(900)
def test_the_replay_asset_puts_the_variant_beside_the_recording(recorded, monkeypatch):
    import dagster as dg

    from assets import replay_assets
    from assets.io import Ledger, ParquetIOManager

    settings, run_id = recorded
    for key, value in settings.environ().items():
        monkeypatch.setenv(key, value)
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("runs", [run_id])
    ledger = Ledger()
    result = dg.materialize(
        replay_assets,
        partition_key=run_id,
        instance=instance,
        resources={"ledger": ledger, "io_manager": ParquetIOManager(ledger=ledger)},
        run_config={"ops": {"replay": {"config": {"variant": "per_trajectory", "updates": "1"}}}},
    )
    (row,) = _materialized(settings, run_id)
    assert row["update_step"] == 1 and row["exact"] and row["loss_replayed"] == row["loss_recorded"]
    variant = dict(row["stats_variant"])
    assert variant["weight_mass_failure"] == pytest.approx(0.5) and row["kl_recorded_variant"] > 0  # as by hand above
    assert [e.passed for e in result.get_asset_check_evaluations()] == [True]


@slow
@pytest.mark.timeout(900)
def test_replay_launched_from_the_dagster_ui(recorded, tmp_path):
    """A person opens the `replay` asset in `dagster dev`, clicks Materialize and launches it for the
    run (the default config: the recorded config, every update); it replays bit for bit."""
    import time

    from playwright.sync_api import sync_playwright

    from test_dagster_ui import (
        _wait,
        dagster_dev_server,
        finished_runs,
        launch_all_partitions,
        open_ui,
        wait_for_partitions,
    )

    settings, run_id = recorded
    with dagster_dev_server(tmp_path, settings.environ()) as base:
        wait_for_partitions(base, "replay")
        with sync_playwright() as p:
            browser, page = open_ui(p, base, "/assets/replay")
            try:
                launch_all_partitions(page, "Materialize")
                t0 = time.monotonic()
                runs = _wait("the replay to finish", lambda: finished_runs(base), timeout=400)
                print(f"replay launched from the UI, {len(runs)} runs done after {time.monotonic() - t0:.0f} s")
                assert {r["status"] for r in runs} == {"SUCCESS"}, runs
            finally:
                page.screenshot(path=str(tmp_path / "replay_asset.png"))
                browser.close()
    rows = _materialized(settings, run_id)
    assert [r["update_step"] for r in rows] == [0, 1] and all(r["exact"] for r in rows), rows
    assert all(r["loss_variant"] is None for r in rows)


@pytest.fixture(scope="module")
def recorded_epochs(module_settings, tmp_path_factory):
    """Run `re-*`: 2 batches of 2 groups, 2 PPO epochs of 2 minibatches each (4 optimizer steps a version),
    a warm-up, and the shuffled-rewards control; 1 process."""
    import os

    from pipeline.bus import create_topics

    settings = module_settings.model_copy(
        update={"topic_prefix": f"t{uuid.uuid4().hex[:8]}", "ledger_uri": str(tmp_path_factory.mktemp("ledger"))}
    )
    create_topics(settings)
    run_id = f"re-{uuid.uuid4().hex[:6]}"
    publish_groups(settings, run_id, 4)
    config = TrainConfig(
        run_id=run_id,
        groups_per_update=2,
        minibatches=2,
        ppo_epochs=2,
        warmup_updates=3,
        lr=1e-3,
        control="shuffled_rewards",
        max_updates=8,
        batch_timeout_s=30,
    )
    assert launch(config, nproc=1, env={**os.environ, **settings.environ()}) == 0
    LedgerWriter(settings).sync(idle_exit_s=3.0)
    return settings, run_id, config


@slow
@pytest.mark.timeout(900)
def test_epochs_schedule_and_control_replay_bit_exact(recorded_epochs):
    settings, run_id, config = recorded_epochs
    results = replay(settings, run_id)
    assert [b.version_before for b in results] == [0, 1]
    steps = [u for b in results for u in b.recorded]
    assert [u.update_step for u in steps] == list(range(8))
    assert [u.version_after for u in steps] == [0, 0, 0, 1, 1, 1, 1, 2]
    assert [u.stats["lr"] for u in steps] == [config.lr_at(s) for s in range(8)]
    assert [u.group_ids for u in steps[:2]] == [u.group_ids for u in steps[2:4]]  # epoch 2 repeats the minibatches
    assert max(u.stats["clip_frac"] for u in steps) > 0 or max(u.stats["approx_kl"] for u in steps) > 0
    for b in results:
        assert b.exact, [(r.loss, u.loss) for r, u in zip(b.same, b.recorded)]
