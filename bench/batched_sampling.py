"""Batched against unbatched sampling: actions/s and episodes/s of the local policy for 1, 2, 4 and 8
workers, on boxes (no browser: model-bound) and on MiniWoB++ (Chromium: browser-bound).

    .venv/bin/python bench/batched_sampling.py [--workers 1,2,4,8] [--suites boxes,miniwob] [--seconds 40]
        [--baseline GIT_REF]

The policy is the controlled task's SFT warm start (`app.learning.warm_start`, built once per run, or
`--model-dir`), so responses have a trained policy's length. Each point runs a pool in a fresh process
for a fixed wall time, on one local stack, in three arms side by side:
- `before`: the code at `--baseline` (default 549671a, before batching: each worker's forward passes
  on whichever executor thread it got, under one lock), from a git worktree;
- `alone`: today's code with `max_batch` 1 (every prompt decoded alone, on the one model thread);
- `batched`: today's code, every waiting prompt decoded together.
Writes bench/out/batched_sampling.json.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from stack import local_stack

console = Console()
OUT = Path(__file__).parent / "out"


ARMS = {"before": None, "alone": 1, "batched": 64}
"""Arm -> `max_batch` (None: the baseline's code, which has no such setting)."""


def one(suite: str, workers: int, arm: str, model_dir: Path, seconds: float) -> None:
    """One point, in this process (the stack comes from the environment); prints its row as JSON."""
    from pipeline.settings import StackSettings
    from rollout.episode import EpisodeConfig
    from rollout.run import RolloutRequest, run_rollout

    settings = StackSettings()
    max_batch = ARMS[arm]

    stop, first = threading.Event(), []
    marks: list[tuple[float, int, int]] = []

    def progress(pool) -> None:
        now = time.monotonic()
        if not first:
            first.append(now)
            threading.Timer(seconds, stop.set).start()
        marks.append((now, pool.stats.episodes, pool.stats.steps))

    batching = {} if max_batch is None else {"max_batch": max_batch}
    stats = run_rollout(
        settings,
        RolloutRequest(
            suite=suite,
            policy="local",
            model_dir=model_dir,
            workers=workers,
            group_size=workers,
            episodes=None,
            temperature=1.0,
            episode=EpisodeConfig(som=True),
            run_id=f"bench-{suite}-{workers}-{arm}",
            **batching,
        ),
        show_progress=False,
        stop=stop,
        on_progress=progress,
    )
    t0, e0, s0 = marks[0]
    t1, e1, s1 = marks[-1]
    print(
        json.dumps(
            {
                "suite": suite,
                "workers": workers,
                "arm": arm,
                "seconds": t1 - t0,
                "episodes_per_s": (e1 - e0) / max(t1 - t0, 1e-9),
                "actions_per_s": (s1 - s0) / max(t1 - t0, 1e-9),
                "success": stats.successes / max(stats.episodes, 1),
            }
        )
    )


def measure(settings, tree: Path, suite: str, workers: int, arm: str, model_dir: Path, seconds: float) -> dict:
    """One point in a fresh process whose imports resolve to `tree` (this checkout or the baseline's)."""
    env = {**os.environ, **settings.environ(), "PYTHONPATH": str(tree)}
    out = subprocess.run(
        [sys.executable, __file__, "one", suite, str(workers), arm, str(model_dir), str(seconds)],
        env=env,
        cwd=tree,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(
    workers: str = "1,2,4,8",
    suites: str = "boxes,miniwob",
    seconds: float = 40.0,
    model_dir: Path | None = None,
    baseline: str = "549671a",
) -> None:
    from app.learning import controlled_warm_start

    rows = []
    here = Path(__file__).resolve().parents[1]
    with local_stack() as (_, settings, d):
        if model_dir is None:
            model_dir = controlled_warm_start(settings, d, say=console.print)
        before = d / "baseline"
        subprocess.run(
            ["git", "-C", str(here), "worktree", "add", "--detach", str(before), baseline],
            check=True,
            capture_output=True,
        )
        try:
            trees = {"before": before, "alone": here, "batched": here}
            for suite in suites.split(","):
                for n in (int(w) for w in workers.split(",")):
                    for arm, tree in trees.items():
                        rows.append(measure(settings, tree, suite, n, arm, model_dir.resolve(), seconds))
                        console.print(rows[-1])
        finally:
            subprocess.run(["git", "-C", str(here), "worktree", "remove", "--force", str(before)], capture_output=True)
    OUT.mkdir(exist_ok=True)
    (OUT / "batched_sampling.json").write_text(json.dumps(rows, indent=2))
    table = Table(title=f"local policy sampling, {seconds:g} s a point: episodes/s (actions/s)")
    for c in ("suite", "workers", *ARMS, "batched / before", "batched / alone"):
        table.add_column(c, justify="right")
    for i in range(0, len(rows), len(ARMS)):
        arms = {r["arm"]: r for r in rows[i : i + len(ARMS)]}
        eps = {a: r["episodes_per_s"] for a, r in arms.items()}
        table.add_row(
            arms["before"]["suite"],
            str(arms["before"]["workers"]),
            *(f"{eps[a]:.2f} ({arms[a]['actions_per_s']:.2f})" for a in ARMS),
            f"{eps['batched'] / eps['before']:.2f}x",
            f"{eps['batched'] / eps['alone']:.2f}x",
        )
    console.print(table)


if __name__ == "__main__":
    if sys.argv[1:2] == ["one"]:  # one point, in the process `measure` starts
        sys.argv.pop(1)
        typer.run(one)
    else:
        typer.run(main)
