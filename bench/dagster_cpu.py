"""Dagster's CPU during a live run: the sensor that refreshed every asset of a changed run on every tick
(`before`), against the one that refreshes only what changed, a run at most every 2 minutes (`now`).

One live training run (`awrl run`'s code: the boxes suite, the scripted demo policy, the torchrun
trainer, the ledger writer) on the local stack; a second ledger writer (its own consumer group) copies
the same events into a second ledger. Two `dagster dev` run side by side, each on its own ledger and
its own instance: `before` from a git worktree at `--before`, `now` from this checkout. Both therefore
see the same event stream, on the same loaded machine, at the same time. Measured over the run, per
arm: CPU seconds of the whole `dagster dev` process tree (webserver, daemon, code server and every
run worker it launched, counted when reaped), and the runs its sensor launched.

    .venv/bin/python bench/dagster_cpu.py [--minutes 5] [--before bcc2bbb]
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from dataclasses import replace
from pathlib import Path

import psutil
import typer
from rich.console import Console
from rich.table import Table

from app.training import RunConfig, run_training
from pipeline.bus import create_topics
from pipeline.stack.local import LocalStack
from pipeline.stack.process import free_port
from trainer.config import TrainConfig

HERE = Path(__file__).resolve().parents[1]
WRITER = """
import sys
from pipeline.ledger import LedgerConfig, LedgerWriter
from pipeline.settings import StackSettings
LedgerWriter(StackSettings(), LedgerConfig(consumer_group="ledger-bench-copy")).sync(follow=True)
"""
RUNS = "{ runsOrError { ... on Runs { results { status tags { key value } } } } }"
console = Console()


def tree_cpu_s(pid: int) -> float:
    """User + system CPU of a process tree: each living process's own time plus that of the children it
    reaped (which covers their reaped children in turn)."""
    total = 0.0
    try:
        root = psutil.Process(pid)
        for p in [root, *root.children(recursive=True)]:
            try:
                t = p.cpu_times()
                total += t.user + t.system + t.children_user + t.children_system
            except psutil.NoSuchProcess:
                pass
    except psutil.NoSuchProcess:
        pass
    return total


def sensor_runs(base: str) -> tuple[int, int]:
    """(runs the sensor launched, of which succeeded)."""
    req = urllib.request.Request(
        f"{base}/graphql", data=json.dumps({"query": RUNS}).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        runs = json.load(resp)["data"]["runsOrError"]["results"]
    ours = [r for r in runs if any(t["key"] == "dagster/sensor_name" for t in r["tags"])]
    return len(ours), sum(r["status"] == "SUCCESS" for r in ours)


def start_dagster(src: Path, home: Path, env: dict[str, str], log: Path) -> tuple[subprocess.Popen, str]:
    home.mkdir(parents=True)
    (home / "dagster.yaml").write_text((HERE / "dagster.yaml").read_text() + "telemetry:\n  enabled: false\n")
    port = free_port()
    proc = subprocess.Popen(
        [str(Path(sys.executable).with_name("dagster")), "dev", "-m", "assets", "-h", "127.0.0.1", "-p", str(port)],
        cwd=src,
        env={**os.environ, **env, "DAGSTER_HOME": str(home), "PYTHONPATH": str(src)},
        stdout=open(log, "wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if urllib.request.urlopen(f"{base}/server_info", timeout=5).status == 200:
                return proc, base
        except OSError:
            time.sleep(2)
    raise RuntimeError(f"dagster dev did not answer: {log.read_text()[-2000:]}")


def stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def main(minutes: float = 5.0, before: str = "bcc2bbb") -> None:
    with tempfile.TemporaryDirectory(prefix="dagster-cpu-") as tmp, tempfile.TemporaryDirectory() as tree:
        tmp_path = Path(tmp)
        subprocess.run(["git", "worktree", "add", "--detach", tree, before], cwd=HERE, check=True, capture_output=True)
        stack = LocalStack.up(tmp_path / "stack", durable=False)
        procs: list[subprocess.Popen] = []
        try:
            settings = stack.settings().model_copy(
                update={"topic_prefix": f"b{uuid.uuid4().hex[:6]}", "ledger_uri": str(tmp_path / "ledger-before")}
            )
            create_topics(settings)
            copy = {**settings.environ(), "AWRL_LEDGER_URI": str(tmp_path / "ledger-now")}
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", WRITER],
                    cwd=HERE,
                    env={**os.environ, **copy},
                    stdout=open(tmp_path / "writer.log", "wb"),
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
            arms = {}
            for arm, src, env in (("before", Path(tree), settings.environ()), ("now", HERE, copy)):
                proc, base = start_dagster(src, tmp_path / f"home-{arm}", env, tmp_path / f"dagster-{arm}.log")
                procs.append(proc)
                arms[arm] = (proc, base)
            console.print(f"both dagster dev up; a {minutes:g}-minute live run starts")
            cpu0 = {arm: tree_cpu_s(p.pid) for arm, (p, _) in arms.items()}
            t0 = time.monotonic()
            config = RunConfig(
                minutes=minutes,
                rollout=replace(RunConfig().rollout, policy="demo", noise=0.5),
                train=TrainConfig(run_id="", groups_per_update=2),
                log_dir=tmp_path / "runs",
            )
            summary = run_training(settings, config)
            seconds = time.monotonic() - t0
            cpu = {arm: tree_cpu_s(p.pid) - cpu0[arm] for arm, (p, _) in arms.items()}
            launched = {arm: sensor_runs(base) for arm, (_, base) in arms.items()}
        finally:
            for p in reversed(procs):
                stop(p)
            stack.down()
            subprocess.run(["git", "worktree", "remove", "--force", tree], cwd=HERE, capture_output=True)
    table = Table(
        title=f"dagster dev during a live run ({seconds / 60:.1f} min, {summary.episodes} episodes, "
        f"{summary.updates} updates)"
    )
    for c in ("arm", "dagster CPU s", "CPU share of one core", "sensor runs launched", "succeeded"):
        table.add_column(c, justify="right")
    for arm in ("before", "now"):
        table.add_row(arm, f"{cpu[arm]:.1f}", f"{cpu[arm] / seconds:.1%}", str(launched[arm][0]), str(launched[arm][1]))
    console.print(table)
    console.print(f"now / before, CPU: {cpu['now'] / cpu['before']:.2f}")


if __name__ == "__main__":
    typer.run(main)
