"""`awrl train`: write the config and hand it to torchrun (the entry point is `trainer.train`)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from pipeline.stack.process import dies_with_parent, start_child, stop_child
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


def thread_share(nproc: int, beside: int = 0, cores: int | None = None) -> int:
    """Intra-op threads for each of `nproc` trainer processes that share this host's CPU with `beside`
    other computing processes (a pool with a local model): the cores split evenly, at least 1 each.
    torch's default gives every process every core, and OpenMP threads then spin-wait on each other:
    on 2 cores a trainer step beside a sampling pool took 3-4x as long (bench/threads.py)."""
    cores = cores or len(os.sched_getaffinity(0))
    return max(1, cores // (nproc + beside))


def torchrun_command(config: TrainConfig, config_path: Path, nproc: int, nodes: Nodes = Nodes()) -> list[str]:
    """The launch; `python -m torch.distributed.run` is what the `torchrun` script runs."""
    if problem := nodes.problem():
        raise ValueError(problem)
    if nodes.nnodes == 1:
        where = ["--standalone"]
    else:
        where = [
            f"--nnodes={nodes.nnodes}",
            f"--node-rank={nodes.node_rank}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={nodes.rdzv_endpoint}",
            f"--rdzv-id={config.run_id}",
        ]
    rank = dies_with_parent([sys.executable, "-m", "trainer.train", "--config", str(config_path)])
    return [sys.executable, "-m", "torch.distributed.run", *where, f"--nproc_per_node={nproc}", "--no-python", *rank]


def start(
    config: TrainConfig,
    nproc: int = 1,
    env: dict[str, str] | None = None,
    log: IO | None = None,
    cpus: str | None = None,
    nodes: Nodes = Nodes(),
    threads: int | None = None,
) -> subprocess.Popen:
    """Start the trainer in `nproc` processes, a child of this process (`start_child`; stop it with
    `stop_child`: nothing is lost, a restarted trainer resumes from the last published version). `cpus`:
    run them on these cores only (`taskset -c`, e.g. "1"), as when rollout and training each get
    their own share of the machine. `threads`: each process's intra-op threads (`OMP_NUM_THREADS`, which
    torch reads at start-up; `thread_share`); None: the environment's, else torch's default."""
    if threads is not None:
        env = {**(os.environ if env is None else env), "OMP_NUM_THREADS": str(threads)}
    path = Path(tempfile.mkdtemp(prefix="awrl-train-")) / "config.json"
    path.write_text(config.model_dump_json(indent=2))
    command = torchrun_command(config, path, nproc, nodes)
    if cpus is not None:
        command = ["taskset", "-c", cpus, *command]
    return start_child(command, env, log)


def launch(config: TrainConfig, nproc: int = 1, env: dict[str, str] | None = None, nodes: Nodes = Nodes()) -> int:
    """Run the trainer in `nproc` processes on this node until it stops; its exit status."""
    proc = start(config, nproc, env, nodes=nodes)
    try:
        return proc.wait()
    finally:
        stop_child(proc)
