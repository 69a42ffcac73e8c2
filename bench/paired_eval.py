"""A paired evaluation of model directories: every policy on the same held-out instances.

    .venv/bin/python bench/paired_eval.py [--model DIR --label NAME --temperature T ...]
        [--suite boxes] [--split test] [--difficulty easy] [--instances 8] [--samples 2] [--workers 4]

A fresh local stack; `rollout.evaluate.evaluate_paired` runs each `--model` (repeat it; `--label` and
`--temperature` pair with it by position) on the first `--instances` of a fixed seeded order of the
split, `--samples` episodes an instance. Prints each policy's success (Wilson 95%), its invalid-action
share, and its difference to the first policy with a bootstrap 95% interval clustered by instance;
writes bench/out/paired_eval.json. Without `--model`: the untrained tiny VLM at temperature 1 against
itself at 0.5 on the boxes suite (no browser), 8 instances x 2 episodes: a smoke run of a minute or so.
`awrl eval --models DIR DIR` does the same on a running stack.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from stack import local_stack

console = Console()
OUT = Path(__file__).parent / "out"


def main(
    model: list[Path] = typer.Option(None, "--model", help="A model directory (repeatable)."),
    label: list[str] = typer.Option(None, "--label", help="Name of each --model, in order."),
    temperature: list[float] = typer.Option(None, "--temperature", help="Temperature of each --model, in order."),
    suite: str = "boxes",
    split: str = "test",
    difficulty: str | None = None,
    instances: int = 8,
    samples: int = 2,
    workers: int = 4,
) -> None:
    from model.hf_io import ensure_policy
    from rollout.evaluate import EvalPolicy, evaluate_paired

    models = model or [ensure_policy()] * 2
    temperatures = temperature or ([1.0, 0.5] if not model else [1.0] * len(models))
    labels = label or [f"{m.name}-t{t:g}" for m, t in zip(models, temperatures)]
    if not len(models) == len(labels) == len(temperatures):
        raise typer.BadParameter("give one --label and one --temperature per --model, or none")
    policies = [EvalPolicy(x, m, t) for x, m, t in zip(labels, models, temperatures)]
    t0 = time.monotonic()
    with local_stack() as (_, settings, _):
        paired = evaluate_paired(
            settings,
            policies,
            suite=suite,
            split=split,
            difficulty=difficulty,
            instances=instances,
            samples=samples,
            workers=workers,
        )
    seconds = time.monotonic() - t0

    table = Table(
        title=f"{suite} {split}: {len(paired.task_ids)} instances x {samples} episodes, paired "
        f"({seconds:.0f} s with the stack)"
    )
    for c in [
        "policy",
        "T",
        "success",
        "Wilson 95%",
        "invalid actions",
        "env errors",
        "minus first",
        "paired bootstrap 95%",
    ]:
        table.add_column(c, justify="right")
    first, record = (
        paired.policies[0],
        {
            "run_id": paired.run_id,
            "task_ids": list(paired.task_ids),
            "seconds": seconds,
            "policies": [],
            "differences": [],
        },
    )
    for p in paired.policies:
        total, d = p.total, p.minus(first) if p is not first else None
        table.add_row(
            p.label,
            f"{p.temperature:g}",
            f"{total.rate:.3f} ({total.successes}/{total.episodes})",
            f"{total.ci95[0]:.3f}-{total.ci95[1]:.3f}",
            f"{p.invalid_share:.3f}",
            str(p.env_errors),
            f"{d.diff:+.3f}" if d else "-",
            f"{d.ci95[0]:+.3f} to {d.ci95[1]:+.3f}" if d else "-",
        )
        record["policies"].append(dict(asdict(p), rate=total.rate, ci95=total.ci95, invalid_share=p.invalid_share))
        if d:
            record["differences"].append(asdict(d))
    console.print(table)
    OUT.mkdir(exist_ok=True)
    (OUT / "paired_eval.json").write_text(json.dumps(record, indent=2, default=str))


if __name__ == "__main__":
    typer.run(main)
