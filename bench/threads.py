"""The trainer and the pool on one CPU: each at torch's default threads, or the cores split between them.

    .venv/bin/python bench/threads.py [--updates 40] [--repeats 2] [--recipe colour|red] [--warm-start DIR]

The RL stage of the controlled learning test (`app.learning.controlled`: boxes, 2 workers, G = 8, the
local model sampling beside a torchrun trainer on the same cores), from one warm start, run once per
arm and repeat, the arms alternating: `split` (`RunConfig.threads` None: `trainer.launch.thread_share`,
1 thread each on 2 cores) and `every core` (both processes at torch's default, as before the split).
`--recipe colour` is the `colour` recipe (`READING_TRAIN`, 8 optimizer steps a version, the SFT anchor
on the warm start's demonstrations), `red` the constant target's (`CONTROLLED_TRAIN`, 4 a version).
Each run stops after `--updates` optimizer steps; prints seconds per optimizer step and episodes per
minute of each run, and the ratio of the arms' medians. `--warm-start DIR` only with `--recipe red`:
the `colour` recipe's anchor reads the demonstrations of the warm start built in the run's own stack.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import typer
from rich.console import Console

from stack import local_stack

console = Console()


def main(updates: int = 40, repeats: int = 2, recipe: str = "colour", warm_start: Path | None = None) -> None:
    from app.learning import (
        CONTROLLED_DEMOS,
        READING_ANCHOR,
        READING_DEMOS,
        READING_TRAIN,
        controlled,
        controlled_warm_start,
        rl_rollout,
        rl_train_config,
    )
    from app.training import RunConfig, run_training

    colour = recipe == "colour"
    cores = len(os.sched_getaffinity(0))
    arms = {"split": None, "every core": cores}
    rows: dict[str, list[tuple[float, float]]] = {arm: [] for arm in arms}
    with local_stack() as (_, settings, d):
        demos = READING_DEMOS if colour else CONTROLLED_DEMOS
        if warm_start is None:
            with console.status("warm start: demonstrations and SFT ..."):
                warm_start = controlled_warm_start(settings, d / "warm", demo_templates=demos, say=lambda _: None)
        for r in range(repeats):
            for arm, threads in arms.items():
                run_id = f"threads-{recipe}-{r}-{arm.replace(' ', '-')}"
                extra = dict(train=READING_TRAIN, anchor_coef=READING_ANCHOR, warm_start_run="warm") if colour else {}
                config = controlled(
                    run_id,
                    d / "runs",
                    warm_start=warm_start,
                    target="colour" if colour else "red",
                    rl_updates=updates,
                    seed=r,
                    **extra,
                )
                run = RunConfig(
                    minutes=90,
                    rollout=rl_rollout(config, run_id, warm_start),
                    train=rl_train_config(config, run_id),
                    run_id=run_id,
                    log_dir=d / "runs",
                    threads=threads,
                )
                t0 = time.monotonic()
                with console.status(f"{run_id}: {updates} optimizer steps ..."):
                    s = run_training(settings, run, record=False)
                seconds = time.monotonic() - t0
                assert s.updates >= updates, f"{run_id} made {s.updates} of {updates} optimizer steps: {s.stopped}"
                rows[arm].append((seconds / s.updates, s.episodes / seconds * 60))
                console.print(
                    f"{run_id}: {s.updates} steps in {seconds:.0f} s ({seconds / s.updates:.2f} s a step), "
                    f"{s.episodes} episodes ({s.episodes / seconds * 60:.0f}/min), trainer idle {s.trainer_idle:.0%}"
                )
    split, every = (statistics.median(x for x, _ in rows[a]) for a in arms)
    console.print("\n| arm | runs | s per optimizer step | episodes/min |\n|---|---|---|---|", highlight=False)
    for arm, xs in rows.items():
        steps = ", ".join(f"{x:.2f}" for x, _ in xs)
        eps = ", ".join(f"{e:.0f}" for _, e in xs)
        console.print(f"| {arm} | {len(xs)} | {steps} | {eps} |", highlight=False)
    console.print(f"\nevery core / split, s per optimizer step (medians): {every / split:.2f}x ({cores} cores)")


if __name__ == "__main__":
    typer.run(main)
