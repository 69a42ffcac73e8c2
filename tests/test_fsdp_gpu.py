"""The FSDP2 trainer on GPUs: NCCL, bf16 parameters with fp32 reduction, one rank per GPU (skipped
without CUDA; `bench/gpu_check.sh` runs it when a GPU machine is available)."""

from __future__ import annotations

import math

import pytest
import torch
from test_trainer import _batch, _torchrun_steps

from trainer.config import TrainConfig
from trainer.update import flatten

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_bf16_fsdp2_over_nccl_matches_the_fp32_update(tmp_path):
    batch, _ = _batch()
    samples, trajectories = flatten(batch)
    config = TrainConfig(run_id="run", lr=1e-3)
    gpus = torch.cuda.device_count()
    cpu = _torchrun_steps(tmp_path, samples, trajectories, config, 1)
    gpu = _torchrun_steps(tmp_path, samples, trajectories, config, gpus, device="cuda")
    for c, g in zip(cpu, gpu):
        assert math.isfinite(g["loss"]) and math.isfinite(g["grad_norm"])
        assert g["loss"] == pytest.approx(c["loss"], rel=0.05, abs=1e-3)  # bf16 activations: percent-level
        assert g["grad_norm"] == pytest.approx(c["grad_norm"], rel=0.05)
        assert g["scored"] == len(samples)
    full = cpu[-1]["memory"][0]
    for rank in gpu[-1]["memory"]:  # fp32 master shards: 1/gpus of the fp32 state each
        assert rank["params_bytes"] <= full["params_bytes"] / gpus * 1.01 + 1024
        assert rank["peak_bytes"] > 0
