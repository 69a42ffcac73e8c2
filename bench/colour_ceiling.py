"""What bounds RL on the boxes `colour` task: can the model learn it at all, from the right answers?

    .venv/bin/python bench/colour_ceiling.py [--demos 300,1200] [--epochs 4]

RL on `colour` stayed at chance (bench/RESULTS.md). Before blaming the RL signal, this asks whether
the small CPU model can represent the task: SFT on oracle demonstrations of `colour` itself (the
right box for the colour the instruction names), then held-out success (96 episodes of unseen
layouts). Side by side, the same SFT on demonstrations of "click any box" (the controlled runs' warm
start: the negative control, at chance by construction). If SFT on the answers stays near 1/4 too,
the bound is the model's reading of colour, not RL; if it rises, RL's signal is what is missing.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import typer
from rich.console import Console

from stack import local_stack

console = Console()
OUT = Path(__file__).parent / "out"


def main(demos: str = "300,1200", epochs: int = 4) -> None:
    from app.learning import LearningCurve, controlled, warm_start
    from rollout.evaluate import evaluate

    rows = []
    with local_stack() as (_, settings, d):
        arms = [("any", int(demos.split(",")[0]))] + [("colour", int(n)) for n in demos.split(",")]
        for shown, n in arms:
            run_id = f"ceiling-{shown}-{n}"
            t0 = time.monotonic()
            config = replace(
                controlled(run_id, d, target="colour"), demo_templates=(shown,), demo_episodes=n, sft_epochs=epochs
            )
            model_dir, sft_s = warm_start(settings, config, run_id, LearningCurve(run_id), console.print)
            # the controlled configuration's own evaluation (its split, episodes, temperature, target)
            result = evaluate(
                settings,
                model_dir=model_dir,
                suite=config.suite,
                split=config.eval_split,
                difficulty=config.difficulty,
                episodes=config.eval_episodes,
                workers=config.workers,
                temperature=config.temperature,
                run_id=f"{run_id}-eval",
                templates=config.templates,
            )
            rows.append(
                {
                    "demonstrations": shown,
                    "episodes": n,
                    "epochs": epochs,
                    "sft_s": sft_s,
                    "success": result.successes / result.episodes,
                    "ci95": result.ci95,
                    "minutes": (time.monotonic() - t0) / 60,
                }
            )
            console.print(rows[-1])
    OUT.mkdir(exist_ok=True)
    (OUT / "colour_ceiling.json").write_text(json.dumps(rows, indent=2))
    for r in rows:
        console.print(
            f"SFT on {r['episodes']} demonstrations of {r['demonstrations']!r}, {epochs} epochs: held-out "
            f"colour success {r['success']:.2f} (95% CI {r['ci95'][0]:.2f}-{r['ci95'][1]:.2f}), "
            f"{r['minutes']:.1f} min"
        )


if __name__ == "__main__":
    typer.run(main)
