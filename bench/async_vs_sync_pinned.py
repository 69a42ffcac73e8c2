"""Async vs sync with the paper's split of resources, next to the shared-core layout, in one run.

    .venv/bin/python bench/async_vs_sync_pinned.py [--minutes 3] [--workers 2]

In the paper, rollout and training run on disjoint GPUs. Here there are 2 cores, so the split is:
core 0 for the policy server (vLLM) and the browsers with the pool, core 1 for the trainer
(`RunConfig.trainer_cpus`, i.e. `taskset -c 1`); every thread of the pool process and of the
server's process group is pinned with `os.sched_setaffinity` (children inherit it). The shared
layout lets the OS place everything on both cores. Both schedules run in both layouts with the same
workload: the `vllm` policy serving the tiny VLM, our sites' Easy train split, G = 2, 2 groups per
update, dynamic sampling off (so every group trains and the comparison is about the schedule).

Prints trajectories/hour, the async/sync ratio per layout, and the busy fraction of each core
(from /proc/stat deltas over each run), and writes bench/out/async_vs_sync_pinned.json.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import psutil
import typer
from rich.console import Console
from rich.table import Table

console = Console()
OUT = Path(__file__).parent / "out"
ROLLOUT_CORES, TRAINER_CORES = {0}, "1"


def pin(pids: list[int], cores: set[int]) -> None:
    """Every thread of these processes (and of their children) on `cores`; later threads inherit."""
    for pid in pids:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
        for proc in procs:
            for tid in os.listdir(f"/proc/{proc.pid}/task"):
                try:
                    os.sched_setaffinity(int(tid), cores)
                except (ProcessLookupError, PermissionError):
                    pass


def core_busy(before, after) -> list[float]:
    out = []
    for b, a in zip(before, after):
        total = sum(a) - sum(b)
        idle = (a.idle + a.iowait) - (b.idle + b.iowait)
        out.append(1 - idle / total if total > 0 else 0.0)
    return out


def main(minutes: float = 3.0, workers: int = 2) -> None:
    from app.training import RunConfig, run_training
    from model.hf_io import ensure_policy
    from pipeline.stack.local import LocalStack
    from pipeline.stack.vllm import VLLMServerConfig
    from trainer.config import TrainConfig

    if os.cpu_count() < 2:
        raise SystemExit("needs 2 cores")
    rows = {}
    with tempfile.TemporaryDirectory() as d:
        model_dir = ensure_policy(Path(d) / "tiny")
        stack = LocalStack.up(Path(d) / "stack", durable=False, vllm=VLLMServerConfig(model_dir=model_dir))
        server = next(s.pid for s in stack.services if s.name == "vllm")
        all_cores = set(range(os.cpu_count()))
        try:
            settings = stack.settings().model_copy(update={"ledger_uri": str(Path(d) / "ledger")})
            for layout in ("shared", "pinned"):
                pin([os.getpid(), server], ROLLOUT_CORES if layout == "pinned" else all_cores)
                for mode in ("sync", "async"):
                    rollout = replace(RunConfig().rollout, policy="vllm", model_dir=model_dir, workers=workers)
                    config = RunConfig(
                        mode=mode,
                        minutes=minutes,
                        rollout=rollout,
                        log_dir=Path(d) / "runs",
                        trainer_cpus=TRAINER_CORES if layout == "pinned" else None,
                        train=TrainConfig(run_id="", groups_per_update=2, dynamic_sampling=False),
                    )
                    before = psutil.cpu_times(percpu=True)
                    with console.status(f"{layout}, {mode}: {minutes:g} min ..."):
                        summary = run_training(settings, config)
                    busy = core_busy(before, psutil.cpu_times(percpu=True))
                    rows[f"{layout} {mode}"] = {
                        **vars(summary),
                        "trajectories_per_hour": summary.trajectories_per_hour,
                        "core_busy": busy,
                    }
                    console.print(
                        f"{layout} {mode}: {summary.episodes} trajectories, {summary.updates} updates, "
                        f"cores busy {[f'{b:.0%}' for b in busy]}"
                    )
        finally:
            stack.down()
    _report(rows, minutes)


def _report(rows: dict, minutes: float) -> None:
    cols = [
        "layout",
        "schedule",
        "trajectories",
        "trajectories/hour",
        "async/sync",
        "updates",
        "trainer idle",
        "core 0 busy",
        "core 1 busy",
    ]
    table = Table(title=f"async vs sync, vllm policy, {minutes:g} min each")
    for c in cols:
        table.add_column(c)
    md = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for name, r in rows.items():
        layout, mode = name.split()
        base = rows[f"{layout} sync"]["trajectories_per_hour"]
        row = [
            layout,
            mode,
            str(r["episodes"]),
            f"{r['trajectories_per_hour']:,.0f}",
            f"{r['trajectories_per_hour'] / base:.2f}x",
            str(r["updates"]),
            f"{r['trainer_idle']:.0%}",
            f"{r['core_busy'][0]:.0%}",
            f"{r['core_busy'][1]:.0%}",
        ]
        table.add_row(*row)
        md.append("| " + " | ".join(row) + " |")
    console.print(table)
    console.print("\n".join(md), markup=False, highlight=False)
    OUT.mkdir(exist_ok=True)
    (OUT / "async_vs_sync_pinned.json").write_text(json.dumps(rows, indent=2, default=str))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    typer.run(main)
