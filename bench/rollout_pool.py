"""Rollout pool benchmark: steps/s for 1, 2, 4, 8 workers with the oracle; the cost of rebuilding a
pool of N browsers (what a synchronous pipeline pays every iteration); memory per browser.

    .venv/bin/python bench/rollout_pool.py [--workers 1,2,4,8] [--episodes-per-worker 4]

One local stack and one run for all figures, so the ratios compare like with like.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from pathlib import Path

import typer
from playwright.async_api import async_playwright
from rich.console import Console
from rich.table import Table

from pipeline.stack.local import LocalStack
from rollout.browser import BrowserWorker
from rollout.run import RolloutRequest, run_rollout

console = Console()


async def rebuild_seconds(n: int) -> tuple[float, float]:
    """Launch n browsers in parallel, open a page in each, close them all; also memory per browser."""
    async with async_playwright() as pw:
        t0 = time.perf_counter()
        workers = [BrowserWorker(pw, f"b{i}") for i in range(n)]
        await asyncio.gather(*(w.ensure() for w in workers))
        contexts = await asyncio.gather(*(w.new_context() for w in workers))
        pages = await asyncio.gather(*(c.new_page() for c in contexts))
        await asyncio.gather(*(p.goto("about:blank") for p in pages))
        up = time.perf_counter() - t0
        rss = sum(w.memory_mb() for w in workers) / n
        await asyncio.gather(*(w.close() for w in workers))
    return up, rss


def main(workers: str = "1,2,4,8", episodes_per_worker: int = 4, suite: str = "sites") -> None:
    counts = [int(x) for x in workers.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as d:
        stack = LocalStack.up(Path(d), durable=False)
        try:
            for n in counts:
                req = RolloutRequest(
                    suite=suite, policy="oracle", workers=n, group_size=min(4, n) or 1, episodes=episodes_per_worker * n
                )
                stats = run_rollout(stack.settings(), req, show_progress=False)
                rebuild, rss = asyncio.run(rebuild_seconds(n))
                rows.append(
                    {
                        "workers": n,
                        "episodes": stats.episodes,
                        "steps": stats.steps,
                        "success": stats.successes / max(stats.episodes, 1),
                        "steps_per_s": stats.steps_per_s,
                        "rebuild_s": rebuild,
                        "dedup_rate": (
                            stats.screenshot_dedup_hits
                            / max(1, stats.screenshot_dedup_hits + stats.screenshots_uploaded)
                        ),
                        "pss_mb_per_browser": rss,
                    }
                )
                console.print(rows[-1])
        finally:
            stack.down()
    base = rows[0]["steps_per_s"]
    table = Table(title=f"rollout pool, oracle policy, suite {suite}")
    for col in (
        "workers",
        "steps/s",
        "speed-up vs 1",
        "success",
        "screenshot dedup",
        "rebuild pool (s)",
        "PSS/browser (MB)",
    ):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            str(r["workers"]),
            f"{r['steps_per_s']:.2f}",
            f"{r['steps_per_s'] / base:.2f}x",
            f"{r['success']:.2f}",
            f"{r['dedup_rate']:.2f}",
            f"{r['rebuild_s']:.2f}",
            f"{r['pss_mb_per_browser']:.0f}",
        )
    console.print(table)
    out = Path(__file__).parent / "out"
    out.mkdir(exist_ok=True)
    (out / "rollout_pool.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    typer.run(main)
