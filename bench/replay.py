"""Replay wall time vs the original run's wall time for the same updates, side by side in one run.

    .venv/bin/python bench/replay.py [--minutes 3] [--nproc 1]
    .venv/bin/python bench/replay.py --policy local --model-dir SFT_DIR --suite miniwob --minutes 5

A fresh local stack; one `awrl run` (async, 2 browsers, G = 2, 1 group per update, dynamic sampling
off; by default the demo policy with noise 0.5, whose scripted rollouts cost almost nothing, so the
run is mostly trainer time: the worst case for replay's advantage) for `minutes`; then every
recorded batch is replayed offline from the ledger and the object store, once with the recorded
config (checked bit for bit) and once with the 1/|tau| variant. Reports the run's wall time from its
start to its last update, the trainer's own compute time for those updates, each replay's wall time,
and the ratios. Writes bench/out/replay-<policy>.json.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import typer
from rich.console import Console

console = Console()
OUT = Path(__file__).parent / "out"


def main(
    minutes: float = 3.0,
    nproc: int = 1,
    policy: str = "demo",
    model_dir: Path = None,
    suite: str = "sites",
    temperature: float = 1.0,
) -> None:
    from analysis.replay import VARIANTS, replay
    from app.training import RunConfig, run_training
    from pipeline.stack.local import LocalStack
    from trainer.config import TrainConfig

    with tempfile.TemporaryDirectory() as d:
        stack = LocalStack.up(Path(d) / "stack", durable=False)
        try:
            settings = stack.settings().model_copy(update={"ledger_uri": str(Path(d) / "ledger")})
            rollout = replace(RunConfig().rollout, policy=policy, noise=0.5, model_dir=model_dir, suite=suite)
            config = RunConfig(
                mode="async",
                minutes=minutes,
                rollout=rollout,
                nproc=nproc,
                log_dir=Path(d) / "runs",
                train=TrainConfig(run_id="", groups_per_update=1, dynamic_sampling=False, temperature=temperature),
            )
            with console.status(f"recording: an async run of {minutes:g} min ..."):
                summary = run_training(settings, config)
            times = {}
            for name, overrides in (("recorded config", None), ("variant 1/|tau|", VARIANTS["per_trajectory"])):
                t0 = time.perf_counter()
                with console.status(f"replaying ({name}) ..."):
                    results = replay(settings, summary.run_id, overrides)
                times[name] = time.perf_counter() - t0
                if overrides is None:
                    exact = sum(b.exact for b in results)
                    compute = sum(u.compute_s for b in results for u in b.recorded)
                    last = max(u.emitted_at for b in results for u in b.recorded)
                    first = min(u.emitted_at for b in results for u in b.recorded)
        finally:
            stack.down()

    run_wall = summary.seconds
    record = {
        "policy": policy,
        "suite": suite,
        "updates": sum(len(b.recorded) for b in results),
        "batches_exact": exact,
        "batches": len(results),
        "run_wall_s": run_wall,
        "first_to_last_update_s": (last - first).total_seconds(),
        "trainer_compute_s": compute,
        "replay_s": times,
        "run_wall_over_replay": {k: run_wall / v for k, v in times.items()},
    }
    OUT.mkdir(exist_ok=True)
    (OUT / f"replay-{policy}.json").write_text(json.dumps(record, indent=2))
    console.print(f"{record['updates']} updates; bit-exact {exact}/{len(results)} batches")
    console.print(f"run wall {run_wall:.0f} s (trainer compute {compute:.0f} s of it)")
    for name, s in times.items():
        console.print(
            f"replay, {name}: {s:.1f} s -> {run_wall / s:.1f}x faster than the run, "
            f"{compute / s:.2f}x the trainer's compute"
        )


if __name__ == "__main__":
    typer.run(main)
