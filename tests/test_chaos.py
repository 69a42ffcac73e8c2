"""The short chaos soak (`bench/chaos.py`): nine faults on the whole system, then the reconciliation.
CI draws its faults from one fixed seed, so that a red run names a sequence to replay, not luck
(`AWRL_CHAOS_SEED=N` picks another, `AWRL_CHAOS_SEED=random` a new one, printed); `bench/chaos.py`
draws new ones for the long soaks.

Budgeted in faults and events, not minutes: a fault comes at least 20 s after the one before and only
once a finished episode more is in the ledger, and after the last one the system runs until the
trainer has published a version with an update. A loaded machine makes the soak longer, never
emptier (a 3-minute clock once left a loaded CI machine with 129 events and no update).

The same soak is also the rebalance-heavy row (`rebalance`): half-way between the drawn faults, 3 more
ledger writers join or leave, and twice a writer is SIGSTOPped past its Kafka session and resumed.
The reconciliation counts what was trained too: no group with a step missing, none left open past its
timeout. A failure prints each service's last log lines."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from chaos import FAULTS, soak

CI_SEED = 413277804
"""Broker, store down and full, pool, trainer, writer twice, browser twice: every row of the matrix."""


@pytest.mark.slow
@pytest.mark.timeout(2400)  # a hang guard: the soak itself stops after 10 min without progress
def test_nine_faults_of_chaos_lose_nothing_and_repeat_nothing(tmp_path):
    chosen = os.environ.get("AWRL_CHAOS_SEED", str(CI_SEED))
    seed = None if chosen == "random" else int(chosen)
    r = soak(tmp_path, faults=9, every_s=20, seed=seed, rebalance=True)
    print(r.report())
    faults = [f for _, f in r.faults]
    assert not r.stalled, r.report()
    assert sum(f in FAULTS for f in faults) == 9, "nine drawn faults"
    assert faults.count("writers_churn") == 9 and faults.count("writer_stop") == 2, "writers in and out between"
    assert r.trajectories > 0 and r.groups > 0 and r.trained > 0, r.report()
    assert r.ok, r.report()
