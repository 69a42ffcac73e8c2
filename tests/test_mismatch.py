"""Sampler-vs-trainer mismatch statistics (`trainer.mismatch`) on a hand-made batch, with the arithmetic."""

from __future__ import annotations

import math

import pytest
import torch

from schemas import UpdateApplied
from trainer.config import TrainConfig
from trainer.mismatch import mismatch_stats
from trainer.update import update_stats

L2, L3 = math.log(2.0), math.log(3.0)
INF, NAN = math.inf, math.nan


def _batch():
    """log r = proximal - behave per token: fresh [0, ln 3, -2 ln 2, -inf sampler], stale [-ln 2, 0, NaN]."""
    behave = torch.tensor([-0.7, -1.4, -0.7, -INF, -0.7, -2.3, -0.5], dtype=torch.float64)  # [7]
    log_r = torch.tensor([0.0, L3, -2 * L2, 0.0, -L2, 0.0, 0.0], dtype=torch.float64)  # [7]
    proximal = behave + log_r  # [7]
    proximal[6] = NAN  # a stale token the trainer scored NaN
    lag = torch.tensor([0, 0, 0, 0, 1, 2, 1])  # [7] 4 fresh, 3 stale
    return proximal, behave, lag


def test_mismatch_statistics_by_hand():
    s = {k: v.item() for k, v in mismatch_stats(*_batch()).items()}
    # fresh: 4 tokens, 1 with a non-finite log-prob; the other 3 have log r = 0, ln 3, -2 ln 2 (r = 1, 3, 1/4)
    assert s["mismatch_tokens"] == 4 and s["mismatch_nonfinite"] == pytest.approx(1 / 4)
    assert s["mismatch_k1"] == pytest.approx((0 - L3 + 2 * L2) / 3)  # mean(-log r)
    assert s["mismatch_k2"] == pytest.approx((0 + L3**2 + 4 * L2**2) / 2 / 3)  # mean((log r)^2 / 2)
    # k3 = r - 1 - log r: 0, 3 - 1 - ln 3, 1/4 - 1 + 2 ln 2
    assert s["mismatch_k3"] == pytest.approx((0 + (2 - L3) + (-0.75 + 2 * L2)) / 3)
    assert (s["mismatch_ratio_min"], s["mismatch_ratio_max"]) == (pytest.approx(0.25), pytest.approx(3.0))
    assert s["mismatch_ratio_tail"] == pytest.approx(2 / 3)  # r = 3 and r = 1/4 lie outside [1/2, 2]
    # stale: 3 tokens, the NaN one left out of k3: (1/2 - 1 + ln 2 + 0) / 2
    assert s["mismatch_stale_tokens"] == 3
    assert s["mismatch_stale_k3"] == pytest.approx((0.5 - 1 + L2) / 2)
    assert all(math.isfinite(v) for v in s.values())


def test_without_fresh_tokens_the_statistics_are_neutral_and_the_event_round_trips():
    proximal, behave, lag = _batch()
    s = {k: v.item() for k, v in mismatch_stats(proximal, behave, lag + 1).items()}
    assert s["mismatch_tokens"] == 0 and s["mismatch_stale_tokens"] == 7
    assert [s[f"mismatch_{k}"] for k in ("nonfinite", "k1", "k2", "k3", "ratio_tail")] == [0.0] * 5
    assert s["mismatch_ratio_min"] == s["mismatch_ratio_max"] == 1.0
    event = UpdateApplied(
        run_id="r",
        update_step=0,
        version_before=0,
        version_after=1,
        group_ids=[],
        trajectory_ids=[],
        loss=0.0,
        grad_norm=0.0,
        stats=s,
        config_json="{}",
        weights_sha256="0" * 64,
        duration_s=0.0,
    )
    assert UpdateApplied.model_validate_json(event.model_dump_json()).stats == s


def test_update_stats_reports_them_in_its_one_read():
    proximal, behave, lag = _batch()
    n = len(lag)
    tokens = dict(
        logprobs=proximal,
        proximal=proximal,
        behave=behave,
        advantages=torch.ones(n, dtype=torch.float64),
        mask=torch.ones(n, dtype=torch.bool),
        weights=torch.ones(n, dtype=torch.float64),
        success=torch.ones(n, dtype=torch.bool),
        entropy=torch.ones(n),
        reference=torch.zeros(0),
        lag=lag,
    )
    stats = update_stats(tokens, TrainConfig(run_id="run"))
    expected = {k: v.item() for k, v in mismatch_stats(proximal, behave, lag).items()}
    assert {k: stats[k] for k in expected} == expected
