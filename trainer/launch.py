"""`awrl train`: write the config and hand it to torchrun (the entry point is `trainer.train`)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from trainer.config import TrainConfig


@dataclass(frozen=True)
class Nodes:
    """This node's place among the run's nodes: every node runs the same `awrl train`, each with its own
    `--node-rank`, and torchrun's c10d rendezvous joins their processes into one FSDP2 world."""

    nnodes: int = 1
    """Nodes in the run (torchrun --nnodes); 1 is a standalone launch."""
    node_rank: int = 0
    """This node's index, 0 to nnodes - 1 (torchrun --node-rank); node 0's first process is rank 0."""
    rdzv_endpoint: str = ""
    """host:port of the rendezvous, an address of node 0 that every node reaches (e.g. 10.0.0.1:29400);
    required with several nodes."""

    def problem(self) -> str | None:
        """What makes this placement unusable, in the CLI's words; None when it is fine."""
        if self.nnodes > 1 and not self.rdzv_endpoint:
            return "--rdzv-endpoint HOST:PORT is required with --nnodes above 1 (an address of node 0)"
        if not 0 <= self.node_rank < self.nnodes:
            return f"--node-rank {self.node_rank} is outside 0..{self.nnodes - 1}"
        return None


def dies_with_parent(command: list[str]) -> list[str]:
    """`command`, killed by the kernel when the process that started it dies (util-linux's `setpriv
    --pdeathsig`, kept across exec). torchrun starts each rank in a session of its own, and `start`
    torchrun in one of its own: without this a SIGKILLed `awrl train` left torchrun and its ranks
    training beside the trainer started in its place (seen in a chaos soak: the same groups trained
    twice, the same version numbers published twice)."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "KILL", "--", *command] if setpriv else command


def torchrun_command(config: TrainConfig, config_path: Path, nproc: int, nodes: Nodes = Nodes()) -> list[str]:
    """The launch; `python -m torch.distributed.run` is what the `torchrun` script runs."""
    if problem := nodes.problem():
        raise ValueError(problem)
    if nodes.nnodes == 1:
        where = ["--standalone"]
    else:
        where = [f"--nnodes={nodes.nnodes}", f"--node-rank={nodes.node_rank}", "--rdzv-backend=c10d",
                 f"--rdzv-endpoint={nodes.rdzv_endpoint}", f"--rdzv-id={config.run_id}"]
    rank = dies_with_parent([sys.executable, "-m", "trainer.train", "--config", str(config_path)])
    return [sys.executable, "-m", "torch.distributed.run", *where, f"--nproc_per_node={nproc}", "--no-python", *rank]


def start(config: TrainConfig, nproc: int = 1, env: dict[str, str] | None = None,
          log: IO | None = None, cpus: str | None = None, nodes: Nodes = Nodes()) -> subprocess.Popen:
    """Start the trainer in `nproc` processes, in a process group of its own (see `stop`). `cpus`:
    run them on these cores only (`taskset -c`, e.g. "1"), as when rollout and training each get
    their own share of the machine."""
    path = Path(tempfile.mkdtemp(prefix="awrl-train-")) / "config.json"
    path.write_text(config.model_dump_json(indent=2))
    command = torchrun_command(config, path, nproc, nodes)
    if cpus is not None:
        command = ["taskset", "-c", cpus, *command]
    return subprocess.Popen(dies_with_parent(command), env=env, stdout=log, stderr=subprocess.STDOUT if log else None,
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


def launch(config: TrainConfig, nproc: int = 1, env: dict[str, str] | None = None, nodes: Nodes = Nodes()) -> int:
    """Run the trainer in `nproc` processes on this node until it stops; its exit status."""
    proc = start(config, nproc, env, nodes=nodes)
    try:
        return proc.wait()
    finally:
        stop(proc)
