"""Write the fixed task set of the sites: `tasks/<site>.jsonl`, one `Task` per line.

    python -m rollout.suites.sites.generate [--out DIR]

Deterministic: each task draws from `random.Random("<site>/<template>/<seed>/<attempt>")` (string
seeds hash identically on every run and platform), and the attempt counter only moves past draws
that repeat an instruction already taken. Rerunning gives byte-identical files.
"""

from __future__ import annotations

import argparse
import random
from collections import Counter
from pathlib import Path

from rollout.suites.sites.task_templates import TEMPLATES, Template
from schemas.observation import Task

TASKS_DIR = Path(__file__).with_name("tasks")
PER_TEMPLATE = {"train": 14, "heldout": 6}
"""Seeds per template by split: 6 templates per site (3 train, 3 held out) -> 60 tasks per site, 18
of them held out (30%)."""


def template_tasks(t: Template, n: int) -> list[Task]:
    tasks: list[Task] = []
    seen: set[str] = set()
    for seed in range(n):
        for attempt in range(100):
            spec = t.draw(random.Random(f"{t.site}/{t.name}/{seed}/{attempt}"))
            if spec.instruction not in seen:
                break
        else:
            raise RuntimeError(f"{t.site}/{t.name}: cannot draw {n} distinct tasks")
        seen.add(spec.instruction)
        tasks.append(
            Task(
                task_id=f"sites.{t.site}.{t.name}.{seed:02d}",
                suite="sites",
                site=t.site,
                template=t.name,
                difficulty=t.difficulty,
                instruction=spec.instruction,
                start_path=spec.start_path,
                seed=seed,
                split=t.split,
                judge=spec.judge,
                oracle=spec.oracle,
            )
        )
    return tasks


def site_tasks(site: str) -> list[Task]:
    return [task for t in TEMPLATES if t.site == site for task in template_tasks(t, PER_TEMPLATE[t.split])]


def write_all(out_dir: Path = TASKS_DIR) -> dict[str, list[Task]]:
    out_dir.mkdir(parents=True, exist_ok=True)
    by_site: dict[str, list[Task]] = {}
    for site in dict.fromkeys(t.site for t in TEMPLATES):
        by_site[site] = tasks = site_tasks(site)
        lines = "".join(task.model_dump_json() + "\n" for task in tasks)
        (out_dir / f"{site}.jsonl").write_text(lines, encoding="utf-8")
    return by_site


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=TASKS_DIR)
    args = ap.parse_args(argv)
    for site, tasks in write_all(args.out).items():
        counts = Counter(f"{t.difficulty}/{t.split}" for t in tasks)
        spread = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
        print(f"{args.out / (site + '.jsonl')}: {len(tasks)} tasks ({spread})")


if __name__ == "__main__":
    main()
