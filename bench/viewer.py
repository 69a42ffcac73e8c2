"""Trajectory viewer page times on a run of ~10k steps: the HTML of each page, as `awrl view` serves it.

    .venv/bin/python bench/viewer.py [--groups 500] [--reps 5]

Starts a throwaway local stack (Tansu + radosgw), writes one run (`samples.write_viewable_run`: groups
of 4 trajectories of 1-10 steps, 24 rendered screenshots) into two ledgers, a local directory and the
stack's S3 bucket, and times every page in one process, both ledgers side by side, after one warm-up
request each (the first request also connects to the ledger; that is reported apart). The budget is
1 s per page; the last column is the median over that budget.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tests/samples.py

import statistics
import tempfile
import threading
import time
import urllib.request

import typer
import uvicorn
from rich.console import Console
from rich.table import Table

from analysis.views import connect
from app.viewer import make_app
from pipeline.stack.local import LocalStack

from samples import write_viewable_run

RUN = "bench-view"


def _serve(settings) -> tuple[uvicorn.Server, str]:
    server = uvicorn.Server(uvicorn.Config(make_app(settings), host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        thread.join(0.05)
    return server, f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"


def _get(url: str) -> float:
    t = time.perf_counter()
    with urllib.request.urlopen(url, timeout=120) as resp:
        resp.read()
    return time.perf_counter() - t


def _pages(settings) -> dict[str, str]:
    con = connect(settings)
    longest, group = con.execute(
        "SELECT trajectory_id, group_id FROM trajectories WHERE run_id = $r ORDER BY num_steps DESC LIMIT 1", {"r": RUN}
    ).fetchall()[0]
    sha = con.execute("SELECT screenshot_sha256 FROM steps WHERE run_id = $r LIMIT 1", {"r": RUN}).fetchall()[0][0]
    steps = con.execute("SELECT count(*) FROM steps WHERE run_id = $r", {"r": RUN}).fetchall()[0][0]
    con.close()
    print(f"{steps} steps; longest trajectory {longest}")
    run = f"/runs/{RUN}"
    return {
        "runs": "/",
        "run": run,
        "run, failures only": f"{run}?outcome=failure",
        "curves (SVG)": f"{run}/curves.svg",
        "trajectory (longest)": f"{run}/trajectories/{longest}",
        "group": f"{run}/groups/{group}",
        "update": f"{run}/updates/0",
        "screenshot": f"/screenshots/{sha}.png",
        "step with marks drawn": f"{run}/trajectories/{longest}/steps/0.png",
    }


def main(groups: int = 500, reps: int = 5) -> None:
    console = Console()
    with tempfile.TemporaryDirectory() as d:
        stack = LocalStack.up(Path(d) / "stack", durable=False)
        try:
            s3 = stack.settings().model_copy(update={"ledger_uri": "s3://awrl/bench-ledger"})
            local = stack.settings().model_copy(update={"ledger_uri": str(Path(d) / "ledger")})
            for settings in (local, s3):
                write_viewable_run(settings, RUN, groups=groups, steps=10, screenshots=24)
            pages = _pages(local)
            servers = {name: _serve(settings) for name, settings in (("local", local), ("s3", s3))}
            first = {name: _get(base + "/") for name, (_, base) in servers.items()}
            for _, base in servers.values():
                for path in pages.values():
                    _get(base + path)  # warm: the verified screenshot cache, matplotlib's first figure
            times = {(page, name): [] for page in pages for name in servers}
            for _ in range(reps):
                for page, path in pages.items():
                    for name, (_, base) in servers.items():
                        times[(page, name)].append(_get(base + path))
            for server, _ in servers.values():
                server.should_exit = True
        finally:
            stack.down()
    table = Table(title=f"viewer page times, {groups * 4} trajectories, median of {reps} (s)")
    for column in ("page", "local ledger", "S3 ledger", "S3 / 1 s budget"):
        table.add_column(column)
    table.add_row("first request (connects)", f"{first['local']:.3f}", f"{first['s3']:.3f}", f"{first['s3']:.2f}")
    for page in pages:
        lo, s3t = statistics.median(times[(page, "local")]), statistics.median(times[(page, "s3")])
        table.add_row(page, f"{lo:.3f}", f"{s3t:.3f}", f"{s3t:.2f}")
    console.print(table)


if __name__ == "__main__":
    typer.run(main)
