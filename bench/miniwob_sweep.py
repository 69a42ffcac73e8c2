"""RL over SFT on MiniWoB++, side by side: several RL configurations from one shared warm start.

    .venv/bin/python bench/miniwob_sweep.py [--rl-minutes 6] [--eval-episodes 200] [--arms demo,no-kl,kl-0.3] [--seed 0]

One fresh local stack. The first arm runs the whole learning loop (untrained evaluation, oracle
demonstrations, SFT, the SFT evaluation, async RL, the RL evaluation); every later arm starts RL from
the same SFT model and is compared with the same SFT point (`LearningConfig.sft_measured_by`), so the
arms differ only in their RL configuration. Prints each arm's RL-over-SFT difference with its
two-proportion z and its paired interval (every point runs the same instances), RL over the best
sharpening baseline (the SFT model sampled at another temperature), and the share of invalid actions
in each evaluation (a worn output format), and writes bench/out/miniwob_sweep.json and bench/out/miniwob_sweep.png.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from rollout.evaluate import two_proportion_z

console = Console(width=max(Console().width, 150))  # the table's 10 columns, also in a log file
OUT = Path(__file__).parent / "out"


ARMS: dict[str, list[str]] = {
    "demo": [],  # make demo's RL: 2 groups a version, 2 epochs, lr 1e-4, KL 1, curriculum on
    "no-kl": ["--train.kl-coef", "0"],
    "no-curriculum": ["--curriculum.no-enabled"],
    "bigger-batch": ["--train.groups-per-update", "4", "--train.minibatches", "2"],
    "lr-2e-4": ["--train.lr", "2e-4"],
    "lr-5e-5": ["--train.lr", "5e-5"],
    "raft": ["--train.loss", "raft"],  # RAFT++: successes only, no push-down
    # a KL penalty to the SFT model (version 0), against the format wear of make demo's third run
    "kl-0.1": ["--train.kl-coef", "0.1"],
    "kl-0.3": ["--train.kl-coef", "0.3"],
    # WebGym's N_i = 1/|tau_i|: a long failure weighs as much as a short success, not 2-3 times more
    "per-trajectory": ["--train.grpo.normalizer", "per_trajectory"],
    # the recipe that made `colour` read its instruction: the gradient on the action's values only,
    # 8 optimizer steps a version at lr 3e-4, no KL penalty, the SFT anchor (PPO-ptx) holding the rest
    "anchored": [
        *("--anchor-coef", "1.0", "--train.tokens.pg", "action", "--train.kl-coef", "0"),
        *("--train.lr", "3e-4", "--train.ppo-epochs", "4", "--train.minibatches", "2"),
    ],
}
"""Each arm as the `awrl demo` flags that launch it on its own: the sweep parses them with the CLI's own
parser, so an arm here is exactly the command printed for it."""


def main(
    rl_minutes: float = 6.0,
    eval_episodes: int = 200,
    demo_episodes: int = 100,
    sft_epochs: int = 4,
    arm_names: str = typer.Option("demo,no-kl,kl-0.3", "--arms"),
    seed: int = typer.Option(0, help="RL task order and sampling (`awrl demo --seed`): one seed of the table."),
    tag: str = typer.Option("", help="Suffix of the output files (bench/out/miniwob_sweep{tag}.json)."),
) -> None:
    from dataclasses import replace

    from app.configs import DemoCommand, parse
    from app.learning import run_learning
    from pipeline.stack.local import LocalStack

    chosen = arm_names.split(",")
    unknown = sorted(set(chosen) - set(ARMS))
    if unknown:
        raise typer.BadParameter(f"unknown arms {unknown}; known: {', '.join(ARMS)}")
    base = [
        "--rl-minutes",
        f"{rl_minutes:g}",
        "--eval-episodes",
        str(eval_episodes),
        "--demo-episodes",
        str(demo_episodes),
        "--sft-epochs",
        str(sft_epochs),
        "--seed",
        str(seed),
    ]
    results = {}
    with tempfile.TemporaryDirectory() as d:
        stack = LocalStack.up(Path(d) / "stack", durable=False)
        try:
            settings = stack.settings().model_copy(update={"ledger_uri": str(Path(d) / "ledger")})
            first = None
            for name in chosen:
                console.rule(f"arm {name}: awrl demo {' '.join(base + ARMS[name])}")
                config = parse(DemoCommand, base + ARMS[name], "awrl demo", "").learning
                config = replace(config, run_id=f"sweep-{name}", out_dir=Path(d) / "learning")
                if first is not None:  # RL from the first arm's SFT model, compared with its SFT point
                    config = replace(
                        config,
                        warm_start=config.out_dir / first.run_id / "sft",
                        sft_measured_by=first.run_id,
                        warm_start_run=first.run_id,  # the anchor's demonstrations (an anchored arm)
                    )
                curve = run_learning(settings, config, say=console.print)
                first = first or curve
                results[name] = curve
            invalid = _invalid_shares(
                settings,
                [first.point("sft").eval_run_id, *(curve.point("rl").eval_run_id for curve in results.values())],
            )
        finally:
            stack.down()
    _report(results, first, rl_minutes, eval_episodes, invalid, seed, tag)


def _invalid_shares(settings, eval_run_ids: list[str]) -> dict[str, float]:
    """The share of invalid actions among each evaluation run's steps (the ledger's `steps` view): the
    sign of a worn output format, which success alone does not separate from a wrong choice."""
    from analysis.views import connect
    from pipeline.ledger import LedgerWriter

    try:  # a column, not the sweep: its results must survive a failure here
        LedgerWriter(settings).sync(idle_exit_s=3.0)
        rows = (
            connect(settings)
            .execute(
                "SELECT run_id, avg((error_class IS NOT DISTINCT FROM 'invalid_action')::INT) FROM steps "
                f"WHERE run_id IN ({', '.join('?' for _ in eval_run_ids)}) GROUP BY run_id",
                eval_run_ids,
            )
            .fetchall()
        )
    except Exception as e:  # noqa: BLE001 - a missing column must not lose the sweep's results
        console.print(f"[red]invalid-action shares unavailable: {e!r}")
        return {}
    return dict(rows)


def _report(
    results, first, rl_minutes: float, eval_episodes: int, invalid: dict[str, float], seed: int, tag: str
) -> None:
    sft = first.point("sft")
    out = {
        "seed": seed,
        "rl_minutes": rl_minutes,
        "eval_episodes": eval_episodes,
        "sft": {"successes": sft.successes, "episodes": sft.episodes, "invalid_share": invalid.get(sft.eval_run_id)},
        "arms": {},
    }
    table = Table(title=f"MiniWoB++ test split, {eval_episodes} episodes a point, RL {rl_minutes:g} min a arm")
    for c in [
        "arm",
        "SFT",
        "RL",
        "RL - SFT",
        "z",
        "paired 95% CI",
        "RL - best sharpening",
        "invalid (SFT -> RL)",
        "RL episodes",
        "versions",
        "dropped",
        "trainer idle",
    ]:
        table.add_column(c, justify="right")
    for name, curve in results.items():
        rl = curve.point("rl")
        diff, z = two_proportion_z(sft.successes, sft.episodes, rl.successes, rl.episodes)
        out["arms"][name] = {
            "successes": rl.successes,
            "episodes": rl.episodes,
            "diff": diff,
            "z": z,
            "rl_episodes": curve.rl.episodes,
            "versions": curve.rl.version,
            "trainer_idle": curve.rl.trainer_idle,
            "invalid_share": invalid.get(rl.eval_run_id),
        }
        paired = [f"{d.ci95[0]:+.3f} to {d.ci95[1]:+.3f}" for d in curve.differences[:1]]
        sharper = [f"{d.diff:+.3f} ({d.ci95[0]:+.3f} to {d.ci95[1]:+.3f})" for d in curve.differences[1:2]]
        out["arms"][name]["differences"] = [str(d) for d in curve.differences]
        shares = (invalid.get(sft.eval_run_id, float("nan")), invalid.get(rl.eval_run_id, float("nan")))
        table.add_row(
            name,
            f"{sft.rate:.3f}",
            f"{rl.rate:.3f}",
            f"{diff:+.3f}",
            f"{z:.2f}",
            (paired or ["-"])[0],
            (sharper or ["-"])[0],
            f"{shares[0]:.2f} -> {shares[1]:.2f}",
            str(curve.rl.episodes),
            str(curve.rl.version),
            str(curve.rl.groups_dropped),
            f"{curve.rl.trainer_idle:.0%}",
        )
    console.print(table)
    OUT.mkdir(exist_ok=True)
    (OUT / f"miniwob_sweep{tag}.json").write_text(json.dumps(out, indent=2))
    _plot(out, OUT / f"miniwob_sweep{tag}.png")


def _plot(out: dict, path: Path) -> None:
    from matplotlib.figure import Figure

    from rollout.evaluate import wilson_interval  # with matplotlib: only when drawing

    names = ["sft", *out["arms"]]
    points = [out["sft"], *out["arms"].values()]
    rates = [p["successes"] / p["episodes"] for p in points]
    cis = [wilson_interval(p["successes"], p["episodes"]) for p in points]
    fig = Figure(figsize=(7, 3.5))
    ax = fig.subplots()
    ax.errorbar(
        range(len(names)),
        rates,
        yerr=[[r - lo for r, (lo, _) in zip(rates, cis)], [hi - r for r, (_, hi) in zip(rates, cis)]],
        fmt="o",
        capsize=4,
    )
    ax.axhline(rates[0], color="grey", lw=0.8, ls="--")
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("held-out success (95% CI)")
    ax.set_title(f"MiniWoB++: RL arms from one SFT model, {out['eval_episodes']} episodes a point")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    typer.run(main)
