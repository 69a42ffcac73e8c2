"""Batched against unbatched sampling: actions/s and episodes/s of the local policy for 1, 2, 4 and 8
workers, on boxes (no browser: model-bound) and on MiniWoB++ (Chromium: browser-bound).

    .venv/bin/python bench/batched_sampling.py [--workers 1,2,4,8] [--suites boxes,miniwob] [--seconds 40]

The policy is the controlled task's SFT warm start (`app.learning.warm_start`, built once per run, or
`--model-dir`), so responses have a trained policy's length. Each point runs the pool for a fixed wall
time with `max_batch` 1 (every prompt decoded alone) and 64 (every waiting prompt together),
alternating, on one local stack; the table gives the ratio of each pair. Writes
bench/out/batched_sampling.json.
"""

from __future__ import annotations

import json
import tempfile
import threading
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

console = Console()
OUT = Path(__file__).parent / "out"


def measure(settings, suite: str, workers: int, max_batch: int, model_dir: Path, seconds: float) -> dict:
    """Run a pool for `seconds` (after its first episode, so start-up is not counted)."""
    from rollout.episode import EpisodeConfig
    from rollout.run import RolloutRequest, run_rollout

    stop, first = threading.Event(), []
    marks: list[tuple[float, int, int]] = []

    def progress(pool) -> None:
        now = time.monotonic()
        if not first:
            first.append(now)
            threading.Timer(seconds, stop.set).start()
        marks.append((now, pool.stats.episodes, pool.stats.steps))

    stats = run_rollout(settings, RolloutRequest(
        suite=suite, policy="local", model_dir=model_dir, workers=workers, group_size=workers, episodes=None,
        temperature=1.0, max_batch=max_batch, episode=EpisodeConfig(som=True), run_id=f"bench-{suite}-{workers}-{max_batch}"),
        stop=stop, on_progress=progress)
    t0, e0, s0 = marks[0]
    t1, e1, s1 = marks[-1]
    return {"suite": suite, "workers": workers, "max_batch": max_batch, "seconds": t1 - t0,
            "episodes_per_s": (e1 - e0) / max(t1 - t0, 1e-9), "actions_per_s": (s1 - s0) / max(t1 - t0, 1e-9),
            "success": stats.successes / max(stats.episodes, 1)}


def main(workers: str = "1,2,4,8", suites: str = "boxes,miniwob", seconds: float = 40.0,
         model_dir: Path | None = None) -> None:
    from app.learning import LearningCurve, controlled, warm_start
    from pipeline.bus import create_topics
    from pipeline.stack.local import LocalStack

    rows = []
    with tempfile.TemporaryDirectory() as d:
        stack = LocalStack.up(Path(d) / "stack", durable=False)
        try:
            settings = stack.settings().model_copy(update={"ledger_uri": str(Path(d) / "ledger")})
            create_topics(settings)
            if model_dir is None:
                model_dir, _ = warm_start(settings, controlled("warm", Path(d)), "warm", LearningCurve("warm"),
                                          say=console.print)
            for suite in suites.split(","):
                for n in (int(w) for w in workers.split(",")):
                    for max_batch in (1, 64):
                        rows.append(measure(settings, suite, n, max_batch, model_dir, seconds))
                        console.print(rows[-1])
        finally:
            stack.down()
    OUT.mkdir(exist_ok=True)
    (OUT / "batched_sampling.json").write_text(json.dumps(rows, indent=2))
    table = Table(title=f"local policy sampling, {seconds:g} s a point, batched (64) vs alone (1)")
    for c in ("suite", "workers", "episodes/s alone", "episodes/s batched", "ratio", "actions/s alone",
              "actions/s batched", "ratio "):
        table.add_column(c, justify="right")
    for alone, batched in zip(rows[::2], rows[1::2]):
        table.add_row(alone["suite"], str(alone["workers"]), f"{alone['episodes_per_s']:.2f}",
                      f"{batched['episodes_per_s']:.2f}", f"{batched['episodes_per_s'] / alone['episodes_per_s']:.2f}x",
                      f"{alone['actions_per_s']:.2f}", f"{batched['actions_per_s']:.2f}",
                      f"{batched['actions_per_s'] / alone['actions_per_s']:.2f}x")
    console.print(table)


if __name__ == "__main__":
    typer.run(main)
