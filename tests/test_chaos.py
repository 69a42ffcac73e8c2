"""The short chaos soak (`bench/chaos.py`): 3 minutes of the whole system, a random fault every 20 s,
then the reconciliation. The seed is printed (and `AWRL_CHAOS_SEED` replays one)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from chaos import soak  # noqa: E402


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_three_minutes_of_chaos_lose_nothing_and_repeat_nothing(tmp_path):
    seed = int(os.environ["AWRL_CHAOS_SEED"]) if os.environ.get("AWRL_CHAOS_SEED") else None
    r = soak(tmp_path, minutes=3, every_s=20, seed=seed)
    print("\n".join(r.lines()))
    assert len(r.faults) >= 8, "a fault every 20 s"
    assert r.trajectories > 0 and r.groups > 0, "the system did work between the faults"
    assert r.ok, "\n".join(r.lines())
