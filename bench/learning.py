"""The learning curve, measured: untrained -> SFT warm start -> async RL, held-out success after each.

    .venv/bin/python bench/learning.py [--suite miniwob] [--demo-episodes 200] [--sft-epochs 5]
                                       [--rl-minutes 10] [--eval-episodes 100]

A fresh local stack; `app.learning.run_learning` with these budgets (the same code `awrl demo`
runs with smaller ones). Prints the curve with Wilson 95% intervals and the two differences the
issue asks about (SFT + RL over untrained, RL over SFT, each with a two-proportion z-test), and writes
bench/out/learning.json and bench/out/learning-curve.png. The curve is also in the stack's ledger
(`evaluations` view) for as long as the stack lives.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from rollout.evaluate import two_proportion_z

console = Console()
OUT = Path(__file__).parent / "out"


def main(
    suite: str = "miniwob",
    demo_episodes: int = 200,
    sft_epochs: int = 5,
    rl_minutes: float = 10.0,
    eval_episodes: int = 100,
    temperature: float = 0.5,
    workers: int = 2,
) -> None:
    from app.learning import LearningConfig, run_learning
    from pipeline.stack.local import LocalStack

    with tempfile.TemporaryDirectory() as d:
        stack = LocalStack.up(Path(d) / "stack", durable=False)
        try:
            settings = stack.settings().model_copy(update={"ledger_uri": str(Path(d) / "ledger")})
            config = LearningConfig(
                suite=suite,
                demo_episodes=demo_episodes,
                sft_epochs=sft_epochs,
                rl_minutes=rl_minutes,
                eval_episodes=eval_episodes,
                temperature=temperature,
                workers=workers,
                out_dir=Path(d) / "learning",
            )
            curve = run_learning(settings, config, say=console.print)
            OUT.mkdir(exist_ok=True)
            shutil.copy(config.out_dir / curve.run_id / "curve.png", OUT / "learning-curve.png")
            record = json.loads((config.out_dir / curve.run_id / "curve.json").read_text())
        finally:
            stack.down()

    table = Table(title=f"{suite}: {eval_episodes} evaluation episodes per point, T={temperature:g}")
    for c in ["stage", "success", "95% CI", "successes", "training wall s"]:
        table.add_column(c, justify="right")
    for p in curve.points:
        table.add_row(
            p.stage,
            f"{p.rate:.2f}",
            f"{p.ci95[0]:.2f}-{p.ci95[1]:.2f}",
            f"{p.successes}/{p.episodes}",
            f"{p.train_s:.0f}",
        )
    console.print(table)
    pts = {p.stage: p for p in curve.points}
    record["differences"] = {}
    for name, a, b in (
        ("sft+rl over untrained", "untrained", "rl"),
        ("sft over untrained", "untrained", "sft"),
        ("rl over sft", "sft", "rl"),
    ):
        if a in pts and b in pts:
            diff, z = two_proportion_z(pts[a].successes, pts[a].episodes, pts[b].successes, pts[b].episodes)
            record["differences"][name] = {"diff": diff, "z": z}
            console.print(f"{name}: {diff:+.3f} absolute (z = {z:.2f})")
    (OUT / "learning.json").write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    typer.run(main)
