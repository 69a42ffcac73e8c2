"""`awrl run` smoke tests with a tiny budget: each schedule runs the pool, the trainer and the ledger
writer together, updates the policy, and leaves the whole run in the ledger."""

from __future__ import annotations

from dataclasses import replace

import pytest

from analysis.ledger import connect
from app.training import RunConfig, run_training
from trainer.config import TrainConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


# The async schedule is exercised end to end by `awrl demo`'s test and by test_train_e2e.
@pytest.mark.parametrize("mode", ["sync"])
def test_a_short_run_trains_and_reaches_the_ledger(settings, tmp_path, mode):
    settings = settings.model_copy(update={"ledger_uri": str(tmp_path / "ledger")})
    config = RunConfig(mode=mode, minutes=1.0, rollout=replace(RunConfig().rollout, policy="demo", noise=0.5),
                       train=TrainConfig(run_id="", groups_per_update=1, dynamic_sampling=False),
                       log_dir=tmp_path / "runs")
    seen = []
    summary = run_training(settings, config, on_progress=seen.append)
    print(f"\n{mode}: {summary}")
    assert summary.episodes > 0 and summary.updates >= 1 and summary.version >= 1 and seen
    assert 0 < summary.record_share < 1 and summary.ledger_share is not None and summary.ledger_share > 0
    con = connect(settings.ledger_uri)
    rows = con.sql(f"select count(*) from updates where run_id = '{summary.run_id}'").fetchall()[0][0]
    assert rows == summary.updates
    assert con.sql(f"select count(*) from trajectories where run_id = '{summary.run_id}'").fetchall()[0][0] > 0
    assert (tmp_path / "runs" / summary.run_id / "trainer.log").stat().st_size > 0
