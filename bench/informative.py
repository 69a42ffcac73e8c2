"""Informative groups with and without the curriculum's instance skip (DAPO's dynamic sampling at the
dispatcher): the share of groups whose rewards are not all equal, and informative groups per minute.

    .venv/bin/python bench/informative.py [--episodes 960] [--group-size 4] [--seeds 8] [--skip 2]

Two RL-free rollouts of the boxes suite (no browser) on one local stack, the same budget and seed,
both with the family curriculum on; the second also skips instances (task and seed) whose last
`--skip` groups were all-equal (`CurriculumConfig.skip_uninformative`). The figures come from the
ledger (`analysis/sql/informative_groups.sql`), as a training run's summary reports them.

The policy stands in for MiniWoB++, where success is all-or-nothing per seed: each instance has a
fixed skill drawn from its task id, hopeless (p = 0, ~45%), mastered (p = 1, ~30%) or learnable
(p = 0.5, ~25%); it clicks the right box with probability p, else a wrong one. Every family's success
stays near 0.4, in band, so the family curriculum alone cannot see which instances are all-equal.
"""

from __future__ import annotations

import hashlib
import json
import random
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from unittest.mock import patch

import typer
from rich.console import Console
from rich.table import Table

from analysis.informative import informative_groups
from analysis.views import connect
from pipeline.ledger import LedgerWriter
from pipeline.stack.local import LocalStack
from rollout.curriculum import CurriculumConfig
from rollout.episode import EpisodeConfig
from rollout.run import RolloutRequest, run_rollout
from rollout.suites.boxes import BoxesSuite
from rollout.suites.boxes.suite import COLOURS
from schemas.observation import Observation, PolicyOutput

console = Console(width=120)
TEMPLATES = ("red", "blue", "green", "black")


class FewSeeds(BoxesSuite):
    """Boxes with `seeds` training seeds per template (MiniWoB++ has 8), so instances recur."""

    def __init__(self, seeds: int):
        super().__init__()
        self.seeds = seeds

    def tasks(self, split=None):
        return [t for t in super().tasks(split) if t.split != "train" or t.seed < self.seeds]


def skill(task_id: str) -> float:
    """The instance's fixed success probability, from its id."""
    u = int(hashlib.sha256(task_id.encode()).hexdigest()[:8], 16) / 2**32
    return 0.0 if u < 0.45 else 1.0 if u < 0.75 else 0.5


class SkillPolicy:
    """Clicks the instruction's box with the instance's `skill`, else the next box (by mark)."""

    name = "skill"

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.version = 0

    async def act(self, obs: Observation) -> PolicyOutput:
        target = COLOURS.index(obs.task.judge["target"])
        mark = target if self.rng.random() < skill(obs.task.task_id) else (target + 1) % len(COLOURS)
        text = json.dumps({"thought": "skill", "memory": {}, "action": {"kind": "click", "mark": mark}})
        return PolicyOutput(
            response_text=text, prompt_token_ids=[], response_token_ids=[], logprobs=[], token_policy_versions=[]
        )

    async def refresh(self, version: int, checkpoint_uri: str, checkpoint_sha256: str | None = None) -> None:
        self.version = version


def main(
    episodes: int = 960,
    group_size: int = 4,
    workers: int = 4,
    seeds: int = 8,
    skip: int = 2,
    skip_passes: int = 4,
    seed: int = 0,
) -> None:
    base = RolloutRequest(
        suite="boxes",
        policy="oracle",
        workers=workers,
        group_size=group_size,
        episodes=episodes,
        templates=TEMPLATES,
        seed=seed,
        episode=EpisodeConfig(som=True),
        journal_dir=None,
        curriculum=CurriculumConfig(),
    )
    arms = {
        "family curriculum": base,
        f"+ instance skip (N={skip})": replace(
            base, curriculum=CurriculumConfig(skip_uninformative=skip, skip_passes=skip_passes)
        ),
    }
    rows = []
    with tempfile.TemporaryDirectory() as d:
        stack = LocalStack.up(Path(d), durable=False)
        try:
            settings = stack.settings()
            for name, req in arms.items():
                run_id = f"informative-{len(rows)}-{int(time.time())}"
                with (
                    patch("rollout.run.make_suite", lambda _name: FewSeeds(seeds)),
                    patch("rollout.run.make_policy", lambda *a, **k: SkillPolicy(seed)),
                ):
                    stats = run_rollout(settings, replace(req, run_id=run_id), show_progress=False)
                rows.append((name, run_id, stats))
                console.print(
                    f"{name}: {stats.episodes} episodes, success {stats.successes / max(stats.episodes, 1):.2f}"
                )
            LedgerWriter(settings).sync(idle_exit_s=3.0)
            con = connect(settings)
            results = [(name, stats, informative_groups(con, run_id)) for name, run_id, stats in rows]
            con.close()
        finally:
            stack.down()
    table = Table(
        title=f"boxes, {len(TEMPLATES)} templates x {seeds} seeds, G={group_size}, {workers} workers, "
        f"{episodes} episodes an arm"
    )
    for col in ("dispatch", "groups", "informative", "share", "minutes", "informative/min", "success"):
        table.add_column(col, justify="right")
    for name, stats, r in results:
        table.add_row(
            name,
            str(r.groups),
            str(r.informative),
            f"{r.share:.2f}",
            f"{r.minutes:.2f}",
            f"{r.per_minute:.1f}",
            f"{stats.successes / max(stats.episodes, 1):.2f}",
        )
    console.print(table)
    out = Path(__file__).parent / "out"
    out.mkdir(exist_ok=True)
    (out / "informative.json").write_text(
        json.dumps([{"arm": name, **vars(r), "episodes": stats.episodes} for name, stats, r in results], indent=2)
    )


if __name__ == "__main__":
    typer.run(main)
