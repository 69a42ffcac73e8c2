"""Async vs sync on the same workload and wall budget, side by side in one run.

    .venv/bin/python bench/async_vs_sync.py [--minutes 4] [--policy demo --noise 0.5]

Three `awrl run`s against one freshly started local stack, one after the other, each for `minutes`:
  sync                       WebGym's schedule: pool rebuilt per iteration, wait for the slowest, train
  async                      AsyncWebRL's: everlasting pool, staleness budget eta = 2, overlap
  async, no everlasting pool the ablation: each browser relaunched after every episode
Same model, tasks (our sites' Easy train split), G = 2, 2 groups per update, 2 browsers, 1 trainer
process. The default workload is the `demo` policy (the oracle's actions, random ones with
probability `noise`, as the tiny VLM's tokens) with dynamic sampling off, so every group trains and
the comparison is about the schedule. Prints trajectories/hour, trainer idle fraction, updates and
staleness, the share of the browser workers' episode time spent recording (screenshots to S3, events
to the broker and their acks) and the ledger writer's CPU time as a share of the same, and draws a
timeline PNG per run into bench/out/.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import replace
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

console = Console()
OUT = Path(__file__).parent / "out"


def main(minutes: float = 4.0, policy: str = "demo", noise: float = 0.5, workers: int = 2) -> None:
    from analysis.timeline import timeline_png
    from analysis.views import connect
    from app.training import RunConfig, run_training
    from pipeline.stack.local import LocalStack
    from trainer.config import TrainConfig

    variants = [("sync", "sync", True), ("async", "async", True), ("async, no everlasting pool", "async", False)]
    summaries = {}
    with tempfile.TemporaryDirectory() as d:
        stack = LocalStack.up(Path(d) / "stack", durable=False)
        try:
            settings = stack.settings().model_copy(update={"ledger_uri": str(Path(d) / "ledger")})
            for name, mode, everlasting in variants:
                rollout = replace(
                    RunConfig().rollout, policy=policy, noise=noise, workers=workers, everlasting=everlasting
                )
                config = RunConfig(
                    mode=mode,
                    minutes=minutes,
                    rollout=rollout,
                    log_dir=Path(d) / "runs",
                    train=TrainConfig(run_id="", groups_per_update=2, dynamic_sampling=False),
                )
                with console.status(f"{name}: {minutes:g} min ..."):
                    summaries[name] = run_training(settings, config)
                console.print(f"{name}: {summaries[name].episodes} trajectories, {summaries[name].updates} updates")
            con = connect(settings.ledger_uri)
            for name, s in summaries.items():
                slug = name.split(",")[0] + ("-rebuilt" if "no everlasting" in name else "")
                timeline_png(con, s.run_id, OUT / f"timeline-{slug}.png", f"{name}: {minutes:g} min")
        finally:
            stack.down()

    base = summaries["sync"].trajectories_per_hour
    cols = [
        "schedule",
        "trajectories",
        "trajectories/hour",
        "vs sync",
        "updates",
        "trainer idle",
        "staleness mean",
        "recording share",
        "ledger writer share",
    ]
    table = Table(title=f"same workload, {minutes:g} min each ({policy}, noise {noise}, {workers} browsers)")
    for c in cols:
        table.add_column(c)
    md = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for name, s in summaries.items():
        row = [
            name,
            str(s.episodes),
            f"{s.trajectories_per_hour:,.0f}",
            f"{s.trajectories_per_hour / base:.2f}x",
            str(s.updates),
            f"{s.trainer_idle:.0%}",
            f"{s.staleness_mean:.2f}",
            f"{s.record_share:.2%}",
            "-" if s.ledger_share is None else f"{s.ledger_share:.2%}",
        ]
        table.add_row(*row)
        md.append("| " + " | ".join(row) + " |")
    console.print(table)
    console.print("\n".join(md), markup=False, highlight=False)
    OUT.mkdir(exist_ok=True)
    (OUT / "async_vs_sync.json").write_text(json.dumps({k: vars(v) for k, v in summaries.items()}, indent=2))


if __name__ == "__main__":
    typer.run(main)
