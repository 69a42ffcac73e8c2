"""Smoke tests of the entry points with tiny budgets."""

from __future__ import annotations

import subprocess
import sys

import pytest

from analysis import connect
from pipeline.stack.local import LocalStack
from pipeline.store import ScreenshotStore


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_demo_runs_on_the_running_stack(stack, tmp_path):
    """Every stage with a tiny budget: untrained eval, demonstrations, SFT, async RL, evals, ledger, Dagster."""
    out = subprocess.run(
        [sys.executable, "-m", "app.cli", "demo", "--suite", "miniwob", "--demo-episodes", "4", "--sft-epochs",
         "1", "--rl-minutes", "0.5", "--eval-episodes", "2", "--no-keep", "--data-dir", str(stack.data_dir)],
        capture_output=True, text=True, timeout=900, cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for row in ("success untrained", "success after sft", "success after rl", "events in ledger",
                "dagster assets materialized"):
        assert row in out.stdout, row
    assert (tmp_path / ".env").exists()
    assert len(list((tmp_path / ".awrl" / "learning").glob("*/curve.png"))) == 1
    run_id = next((tmp_path / ".awrl" / "learning").glob("*/curve.json")).parent.name
    con = connect(stack.settings())
    stages = con.execute("select stage from evaluations where run_id = $r order by train_s, evaluated_at", {"r": run_id}).fetchall()
    assert [s for (s,) in stages] == ["untrained", "sft", "rl"]
    (rl_episodes,) = con.execute("select count(*) from trajectories where run_id = $r", {"r": run_id}).fetchone()
    assert rl_episodes > 0, "the async RL stage ran no episode"
    assert stack.healthy(), "demo must not stop a stack it did not start"


def test_every_verb_has_help():
    top = subprocess.run([sys.executable, "-m", "app.cli", "--help"], capture_output=True, text=True)
    assert top.returncode == 0
    for verb in (["stack"], ["stack", "up"], ["stack", "down"], ["stack", "status"], ["demo"]):
        out = subprocess.run([sys.executable, "-m", "app.cli", *verb, "--help"], capture_output=True, text=True)
        assert out.returncode == 0 and "Usage" in out.stdout, verb


@pytest.mark.slow
def test_durable_store_survives_a_stack_restart(tmp_path):
    stack = LocalStack.up(tmp_path, durable=True)
    try:
        digest = ScreenshotStore.from_settings(stack.settings()).put(b"\x89PNG survives restart")
        creds = stack.s3
    finally:
        stack.down()
    stack = LocalStack.up(tmp_path, durable=True)
    try:
        assert stack.s3.access_key == creds.access_key
        assert ScreenshotStore.from_settings(stack.settings()).get(digest) == b"\x89PNG survives restart"
    finally:
        stack.down()
