"""What a model judge costs a rollout: the judge's latency per trajectory, and the pool's throughput
with the model judge against the rule judge, side by side on one stack.

    .venv/bin/python bench/judge_cost.py [--episodes 96] [--repeats 2] [--url URL --model NAME]

Boxes tasks (no browser) played by the oracle policy on 4 workers, groups of 4. Each repeat runs the
rule-judged arm, then the model-judged arm (alternating, so drift in the machine's load hits both).
The model judge is the deterministic rule-following judge of the tests (`tests/judge_server.py`, a
real HTTP server) unless `--url` names another OpenAI-compatible server, e.g. the stack's vLLM
(`AWRL_VLLM_URL` without `/v1`). The latency is each `TrajectoryJudged.latency_s` from the ledger
(retries included); the agreement of that run with the rule comes from `awrl_judge_agreement`.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from analysis.views import connect
from pipeline.ledger import LedgerWriter
from pipeline.stack.local import LocalStack
from rollout.episode import EpisodeConfig
from rollout.judges import ModelJudgeConfig
from rollout.run import RolloutRequest, run_rollout

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from judge_server import JudgeServer  # noqa: E402 - the tests' judge, found on their path

console = Console()
OUT = Path(__file__).parent / "out"


def main(episodes: int = 96, repeats: int = 2, url: str = "", model: str = "rule-judge") -> None:
    rows = []
    with tempfile.TemporaryDirectory() as d, JudgeServer("rule") as server:
        stack = LocalStack.up(Path(d) / "stack", durable=False)
        try:
            settings = stack.settings().model_copy(update={"ledger_uri": str(Path(d) / "ledger")})
            judge = ModelJudgeConfig(url=url or server.url, model=model)
            base = RolloutRequest(suite="boxes", policy="oracle", workers=4, group_size=4, episodes=episodes)
            for r in range(repeats):
                for arm in ("rule", "model"):
                    run_id = f"judge-cost-{arm}-{r}"
                    episode = EpisodeConfig(som=True, judge=arm, model_judge=judge)
                    t0 = time.monotonic()
                    stats = run_rollout(settings, replace(base, run_id=run_id, episode=episode), show_progress=False)
                    seconds = time.monotonic() - t0
                    rows.append(dict(arm=arm, repeat=r, run=run_id, episodes=stats.episodes, seconds=seconds))
            LedgerWriter(settings).sync(idle_exit_s=3.0)
            con = connect(settings)
            acc = con.execute(
                "SELECT accuracy FROM awrl_judge_agreement('model', 'rule') WHERE task_family = '(all)'"
            ).fetchone()
            for row in rows:
                if row["arm"] == "model":
                    row["agreement_all_runs"] = acc[0] if acc else None
                    lat = [
                        x
                        for (x,) in con.execute(
                            "SELECT latency_s FROM verdicts WHERE run_id = ? AND judge = 'model'", [row["run"]]
                        ).fetchall()
                    ]
                    row["latency_mean_s"] = statistics.fmean(lat)
                    row["latency_p95_s"] = statistics.quantiles(lat, n=20)[-1]
        finally:
            stack.down()
    _report(rows, url or "tests/judge_server.py (rule)")


def _report(rows: list[dict], judge: str) -> None:
    table = Table(title=f"rollout throughput, rule judge vs model judge ({judge})")
    for c in ("repeat", "rule ep/s", "model ep/s", "model / rule", "judge latency mean / p95 (s)"):
        table.add_column(c, justify="right")
    ratios = []
    for r in sorted({row["repeat"] for row in rows}):
        rule, model = (next(x for x in rows if x["repeat"] == r and x["arm"] == a) for a in ("rule", "model"))
        rule_rate, model_rate = rule["episodes"] / rule["seconds"], model["episodes"] / model["seconds"]
        ratios.append(model_rate / rule_rate)
        table.add_row(
            str(r),
            f"{rule_rate:.2f}",
            f"{model_rate:.2f}",
            f"{ratios[-1]:.2f}",
            f"{model['latency_mean_s']:.3f} / {model['latency_p95_s']:.3f}",
        )
    console.print(table)
    mean = statistics.fmean(ratios)
    console.print(f"throughput with the model judge / with the rule: {mean:.2f} (mean of {len(ratios)})")
    OUT.mkdir(exist_ok=True)
    (OUT / "judge_cost.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    typer.run(main)
