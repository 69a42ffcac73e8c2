"""The FSDP2 trainer on GPUs: NCCL, bf16 parameters with fp32 reduction, one rank per GPU (skipped
without CUDA; `bench/gpu_check.sh` runs it when a GPU machine is available)."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.config import TrainConfig
from trainer.update import flatten

from test_trainer import _batch, _torchrun_steps

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


def test_awrl_train_takes_a_bf16_update_of_the_full_qwen3_vl_2b_architecture(settings, tmp_path):
    """`awrl train` on every GPU of the machine: one bf16 update of Qwen3-VL-2B's architecture at full
    width (every layer, the project's tokenizer), its version published, each rank's memory recorded."""
    import os
    import subprocess
    import sys
    import uuid

    from model.architectures import make_policy
    from model.hf_io import save_policy
    from schemas import UpdateApplied

    from test_train_resume import publish_groups, published, trainer_events

    model, tokenizer = make_policy("qwen3-vl-2b", seed=3)
    model_dir = save_policy(model, tokenizer, tmp_path / "qwen3-vl-2b")
    del model
    run_id = f"gpu2b-{uuid.uuid4().hex[:6]}"
    publish_groups(settings, run_id, 1)  # sampled by the tiny VLM: the same tokenizer, so valid token ids
    gpus = torch.cuda.device_count()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "app.cli",
            "train",
            "--run-id",
            run_id,
            "--model-dir",
            str(model_dir),
            "--groups-per-update",
            "1",
            "--max-updates",
            "1",
            "--batch-timeout-s",
            "60",
            "--nproc",
            str(gpus),
        ],
        env={**os.environ, **settings.environ()},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    events = trainer_events(settings, run_id)
    (update,) = [e for e in events if isinstance(e, UpdateApplied)]
    assert [v.version for v in published(events)] == [0, 1] and math.isfinite(update.loss)
    assert len(update.memory) == gpus and all(m.device == "cuda" and m.peak_bytes > 0 for m in update.memory)
    for m in update.memory:
        print(
            f"\n2B bf16 update, rank {m.rank}/{gpus}: params {m.params_bytes / 2**30:.2f} GiB, grads "
            f"{m.grads_bytes / 2**30:.2f}, optimizer {m.optimizer_bytes / 2**30:.2f}, "
            f"peak {m.peak_bytes / 2**30:.2f} GiB; "
            f"update {update.compute_s:.1f} s"
        )
