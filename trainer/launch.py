"""`awrl train`: write the config and hand it to torchrun (the entry point is `trainer.train`)."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from trainer.config import TrainConfig


def torchrun_command(config_path: Path, nproc: int) -> list[str]:
    """The single-node launch; `python -m torch.distributed.run` is what the `torchrun` script runs."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "-m", "trainer.train", "--config", str(config_path)]


def launch(config: TrainConfig, nproc: int = 1, env: dict[str, str] | None = None) -> int:
    """Run the trainer in `nproc` processes until it stops; its exit status."""
    with tempfile.TemporaryDirectory(prefix="awrl-train-") as tmp:
        path = Path(tmp) / "config.json"
        path.write_text(config.model_dump_json(indent=2))
        return subprocess.run(torchrun_command(path, nproc), env=env, check=False).returncode
