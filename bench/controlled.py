"""The controlled learning test, repeated: RL on the boxes task against its shuffled-rewards control.

    .venv/bin/python bench/controlled.py [--repeats 3] [--rl-minutes 3]

Each repeat is `tests/test_learning.py`'s pair on a fresh local stack (`app.learning.controlled`):
demonstrations of "click any box", SFT, then RL on "click the red box" from it, and the same RL with
each group's rewards shuffled. Prints held-out success (96 episodes per point) before and after RL for
both, the rise and the control's drift, and the margins against the test's thresholds; draws success
on the training tasks against policy version for every run (bench/out/controlled.png) and writes
bench/out/controlled.json.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

console = Console()
OUT = Path(__file__).parent / "out"


def main(repeats: int = 3, rl_minutes: float = 3.0) -> None:
    from analysis import connect
    from analysis.curves import compare_versions_png, success_by_version
    from app.learning import controlled, run_learning
    from pipeline.stack.local import LocalStack

    rows, curves = [], {}
    for i in range(repeats):
        with tempfile.TemporaryDirectory() as d:
            stack = LocalStack.up(Path(d) / "stack", durable=False)
            try:
                settings = stack.settings().model_copy(update={"ledger_uri": str(Path(d) / "ledger")})
                t0 = time.monotonic()
                real = run_learning(settings, controlled(f"real-{i}", Path(d), rl_minutes), say=console.print)
                control = run_learning(settings, controlled(f"control-{i}", Path(d), rl_minutes, "shuffled_rewards",
                                                            Path(d) / real.run_id / "sft"), say=console.print)
                con = connect(settings)
                for run in (real, control):
                    curves[run.run_id] = success_by_version(con, run.run_id)
                    sft, rl = run.point("sft"), run.point("rl")
                    rows.append({"run": run.run_id, "sft": sft.rate, "rl": rl.rate, "change": rl.rate - sft.rate,
                                 "versions": run.rl.version, "episodes": run.rl.episodes,
                                 "points": [(p.stage, p.policy_version, p.rate) for p in run.points],
                                 "seconds": time.monotonic() - t0})
            finally:
                stack.down()
    OUT.mkdir(exist_ok=True)
    compare_versions_png(curves, OUT / "controlled.png", title="boxes (red): RL vs shuffled-rewards control")
    (OUT / "controlled.json").write_text(json.dumps(rows, indent=2, default=str))
    table = Table(title=f"controlled task, {rl_minutes:g} min of RL, 96 held-out episodes per point")
    for c in ("run", "sft", "rl", "change", "versions", "RL episodes"):
        table.add_column(c, justify="right")
    for r in rows:
        table.add_row(r["run"], f"{r['sft']:.2f}", f"{r['rl']:.2f}", f"{r['change']:+.2f}", str(r["versions"]),
                      str(r["episodes"]))
    console.print(table)
    rise = min(r["change"] for r in rows if r["run"].startswith("real"))
    drift = max(abs(r["change"]) for r in rows if r["run"].startswith("control"))
    console.print(f"smallest rise {rise:+.2f} (test needs >= 0.40); largest control drift {drift:.2f} (test allows 0.20)")


if __name__ == "__main__":
    typer.run(main)
