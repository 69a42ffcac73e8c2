"""Versions stored in the background (`trainer.versions`): what is stored is the snapshot taken when
the version ended, not the weights the next update has changed meanwhile, and a version is announced
only once every rank's shards are in the object store."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import torch


def test_a_version_is_the_snapshot_and_is_announced_only_once_every_rank_stored_it(settings, tmp_path):
    run_id, out = f"ver-{uuid.uuid4().hex[:6]}", tmp_path / "out.pt"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(Path(__file__).with_name("torchrun_versions.py")),
        run_id,
        str(out),
    ]
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **settings.environ(), "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(out, weights_only=False)
    assert got["durable"] == 2
    for version in (1, 2):
        snapshot, restored = got["snapshots"][version], got["restored"][version]
        assert snapshot.keys() == restored.keys()
        assert all(torch.equal(snapshot[k], restored[k]) for k in snapshot), version
        assert not torch.equal(snapshot["0.weight"], got["after"]["0.weight"])  # the live weights moved on
        # both ranks' shard files and DCP's metadata were in the store when the version was announced
        assert got["announced"][version] == [".metadata", "__0_0.distcp", "__1_0.distcp"], got["announced"]
