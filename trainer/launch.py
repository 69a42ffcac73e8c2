"""`awrl train`: write the config and hand it to torchrun (the entry point is `trainer.train`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import IO

from trainer.config import TrainConfig


def torchrun_command(config_path: Path, nproc: int) -> list[str]:
    """The single-node launch; `python -m torch.distributed.run` is what the `torchrun` script runs."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "-m", "trainer.train", "--config", str(config_path)]


def start(config: TrainConfig, nproc: int = 1, env: dict[str, str] | None = None,
          log: IO | None = None, cpus: str | None = None) -> subprocess.Popen:
    """Start the trainer in `nproc` processes, in a process group of its own (see `stop`). `cpus`:
    run them on these cores only (`taskset -c`, e.g. "1"), as when rollout and training each get
    their own share of the machine."""
    path = Path(tempfile.mkdtemp(prefix="awrl-train-")) / "config.json"
    path.write_text(config.model_dump_json(indent=2))
    command = torchrun_command(path, nproc)
    if cpus is not None:
        command = ["taskset", "-c", cpus, *command]
    return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT if log else None,
                            start_new_session=True)


def stop(proc: subprocess.Popen, timeout_s: float = 30.0) -> int:
    """SIGTERM the trainer's whole process group (launcher and ranks), SIGKILL if it lingers. Nothing is
    lost either way: a restarted trainer resumes from the last published version."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode


def launch(config: TrainConfig, nproc: int = 1, env: dict[str, str] | None = None) -> int:
    """Run the trainer in `nproc` processes until it stops; its exit status."""
    proc = start(config, nproc, env)
    try:
        return proc.wait()
    finally:
        stop(proc)
