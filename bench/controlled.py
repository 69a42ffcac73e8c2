"""The controlled learning test over targets and seeds: does RL rise on every target, and collapse on none?

    .venv/bin/python bench/controlled.py [--targets red,blue,green,black,colour] [--seeds 3]
        [--first-seed 0] [--controls] [--warm-start DIR] [--rl-updates 80] [--rl-minutes 20] [--kl-coef 0]
        [--train KEY=VALUE ...] [--anchor-coef 0] [--warm-start-run warm] [--probe] [--demo-templates named]
        [--arm NAME:KEY=VALUE,... ...]

Each run is `tests/test_learning.py`'s real run (`app.learning.controlled`) on one local stack: RL on
"click the <target> box" (or `colour`: the colour the instruction names) from a warm start at chance,
held-out success (96 episodes a point) before and after. The warm start (demonstrations of "click any
box", SFT) is built once and shared by every run, or taken from `--warm-start`. `--controls` adds each
run's shuffled-rewards control. RL is budgeted by `--rl-updates`; `--rl-minutes` is only a cap, wider
than the test's 10 so that a long run (`colour`, 160 steps) ends by updates, as its control does.
`--kl-coef` sets the controlled configuration's KL penalty to the warm start (`TrainConfig.kl_coef`;
the configuration's own, 1, without it); `--train KEY=VALUE` sets any field of the RL stage's
`TrainConfig` (dotted, JSON values: `--train tokens.pg=action --train lr=3e-4 --train ppo_epochs=4`).
`--anchor-coef` adds the SFT anchor on the warm start's own demonstrations (`TrainConfig.anchor`, PPO-ptx),
read from the ledger as the run `--warm-start-run`'s (`warm`, the id the shared warm start is built under);
their screenshots are copied into each run's own bucket, where its trainer fetches them.
`--demo-templates named,pick` builds the warm start from both kinds of demonstrations (the boxes suite's
docstring says why). `--probe` runs `analysis.probe.colour_probe` on the warm start and on each run's final
version (does the mark depend on the instruction's colour word?). `--arm fast:lr=6e-4,rl_updates=80` runs
each seed once per arm, on the same warm start, with the arm's fields over `--train` (and `rl_updates`
over `--rl-updates`): variants side by side, the warm start's variance shared. A run *collapses* when its final success
is below its warm start. Prints the table and the collapse rate, draws success on the training tasks against
policy version for every run (bench/out/controlled.png), writes bench/out/controlled.json. Each run writes its
checkpoints to a bucket of its own, removed once its row is taken (a version with its optimizer state is
~75 MB, and the local store holds 4 GiB).
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from stack import local_stack

console = Console()
OUT = Path(__file__).parent / "out"


def main(
    targets: str = "red,blue,green,black,colour",
    seeds: int = 3,
    first_seed: int = 0,
    controls: bool = False,
    warm_start: Path | None = None,
    rl_updates: int = 80,
    rl_minutes: float = 20.0,
    kl_coef: float | None = None,
    train: list[str] = typer.Option([], help="KEY=VALUE: a TrainConfig field of the RL stage"),
    anchor_coef: float = 0.0,
    warm_start_run: str = "warm",
    probe: bool = False,
    tag: str = "",
    demo_templates: str = "named",
    arm: list[str] = typer.Option([], help="NAME:KEY=VALUE,...: a variant run beside the others on each seed"),
) -> None:
    from analysis import connect
    from analysis.curves import compare_versions_png, success_by_version
    from analysis.probe import colour_probe
    from analysis.replay import set_fields
    from app.learning import controlled, controlled_warm_start, final_policy, run_learning, share_demonstrations
    from pipeline.s3 import remove_bucket
    from pipeline.store import ScreenshotStore

    rows, curves = [], {}
    tag = tag or (f"-kl{kl_coef:g}" if kl_coef is not None else "")
    overrides, variants = _checked(train, arm)  # before the stack and the warm start: minutes in
    with local_stack() as (_, settings, d):
        if warm_start is None:
            warm_start = controlled_warm_start(
                settings, d, say=console.print, demo_templates=tuple(demo_templates.split(","))
            )
        if probe:
            console.print(f"probe of the warm start {warm_start}: {colour_probe(warm_start)}")
        runs = [(v, c) for v in variants for c in (("none", "shuffled_rewards") if controls else ("none",))]
        for seed in range(first_seed, first_seed + seeds):
            for target in targets.split(","):
                for name, control in runs:
                    fields = {**overrides, **variants[name]}
                    updates = fields.pop("rl_updates", rl_updates)
                    run_id = f"{target}-s{seed}{tag}{name and '-' + name}" + ("-control" if control != "none" else "")
                    t0 = time.monotonic()
                    own = settings.model_copy(update={"s3_bucket": f"awrl-{run_id}"})
                    ScreenshotStore.from_settings(own).ensure_bucket()
                    if anchor_coef:
                        share_demonstrations(settings, own, warm_start_run)
                    config = controlled(
                        run_id,
                        d,
                        control=control,
                        warm_start=warm_start,
                        target=target,
                        rl_updates=updates,
                        rl_minutes=rl_minutes,
                        seed=seed,
                        anchor_coef=anchor_coef,
                        warm_start_run=warm_start_run,
                    )
                    if kl_coef is not None:
                        fields["kl_coef"] = kl_coef
                    config = replace(config, train=set_fields(config.train, fields))
                    run = run_learning(own, config, say=console.print)
                    probed = None
                    if probe:
                        probed = colour_probe(final_policy(own, run_id))
                        console.print(f"probe of {run_id}'s final version: {probed}")
                    curves[run_id] = success_by_version(connect(settings), run_id)
                    remove_bucket(own)
                    sft, rl = run.point("sft"), run.point("rl")
                    rows.append(
                        {
                            "run": run_id,
                            "target": target,
                            "seed": seed,
                            "control": control,
                            "sft": sft.rate,
                            "rl": rl.rate,
                            "change": rl.rate - sft.rate,
                            "versions": run.rl.version,
                            "updates": run.rl.updates,
                            "episodes": run.rl.episodes,
                            "points": [(p.stage, p.policy_version, p.rate) for p in run.points],
                            "probe": None if probed is None else vars(probed),
                            "train": fields,
                            "seconds": time.monotonic() - t0,
                        }
                    )
                    console.print(rows[-1])
    OUT.mkdir(exist_ok=True)
    compare_versions_png(curves, OUT / f"controlled{tag}.png", title=f"boxes: RL by target and seed{tag}")
    (OUT / f"controlled{tag}.json").write_text(json.dumps(rows, indent=2, default=str))
    table = Table(title=f"controlled task, {rl_updates} optimizer steps of RL{tag}, 96 held-out episodes per point")
    for c in ("run", "warm start", "mid-run", "final", "change", "versions", "RL episodes", "minutes"):
        table.add_column(c, justify="right")
    for r in rows:
        mid = ", ".join(f"{rate:.2f} (v{v})" for stage, v, rate in r["points"] if stage.startswith("rl-v"))
        table.add_row(
            r["run"],
            f"{r['sft']:.2f}",
            mid,
            f"{r['rl']:.2f}",
            f"{r['change']:+.2f}",
            str(r["versions"]),
            str(r["episodes"]),
            f"{r['seconds'] / 60:.1f}",
        )
    console.print(table)
    real = [r for r in rows if r["control"] == "none"]
    collapsed = [r["run"] for r in real if r["rl"] < r["sft"]]
    console.print(
        f"collapses: {len(collapsed)} of {len(real)} runs {collapsed}; smallest rise "
        f"{min(r['change'] for r in real):+.2f} (the goal: >= +0.40 on every run)"
    )


def _checked(train: list[str], arm: list[str]) -> tuple[dict, dict[str, dict]]:
    """`--train` and `--arm` parsed and tried on the RL stage's `TrainConfig`; a mistake is one line."""
    from pydantic import ValidationError

    from analysis.replay import parse_values, set_fields
    from app.learning import CONTROLLED_TRAIN

    try:
        overrides, variants = parse_values(train), dict(_arm(a) for a in arm) or {"": {}}
        for fields in variants.values():
            set_fields(CONTROLLED_TRAIN, {k: v for k, v in {**overrides, **fields}.items() if k != "rl_updates"})
    except ValidationError as e:
        error = e.errors()[0]
        raise typer.BadParameter(
            f"{'.'.join(map(str, error['loc']))}: {error['msg']}", param_hint="--train/--arm"
        ) from None
    except (ValueError, KeyError) as e:
        raise typer.BadParameter(str(e.args[0]), param_hint="--train/--arm") from None
    return overrides, variants


def _arm(text: str) -> tuple[str, dict]:
    """`NAME:KEY=VALUE,...` -> (NAME, {KEY: VALUE}); values parsed as `--train`'s are."""
    from analysis.replay import parse_values

    name, _, fields = text.partition(":")
    return name, parse_values([f for f in fields.split(",") if f])


if __name__ == "__main__":
    typer.run(main)
