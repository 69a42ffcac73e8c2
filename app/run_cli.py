"""`awrl demo | run | train | rollout | sft | eval`: the verbs that run something.

Each takes its flags from its command object (`app.configs.COMMANDS`: every field of the config it
wraps is a flag, `--config FILE|NAME` loads a whole config first). Click hands the verb's raw arguments
to tyro while it parses them (`ConfigVerb`), so `--help` is tyro's, a wrong flag fails before anything
runs, and the verb reads the parsed object with `command_of`.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import click
import typer
import typer.core

from app.output import Format, console, emit_record, emit_rows, fail, human

RAW = {
    "context_settings": {"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []},
    "add_help_option": False,
}
"""Typer hands every argument to the verb's parser, tyro (`app.configs.parse`)."""

CONFIG_VERBS: dict[str, str] = {
    "demo": (
        "The main job on the local stack: demonstrations -> SFT -> async RL -> ledger -> drift -> Dagster, "
        "with held-out success before and after."
    ),
    "run": (
        "A training run: the stack (started if needed), the rollout pool, the ledger writer and the "
        "torchrun trainer, with live progress."
    ),
    "train": (
        "Train on a live run's events with torchrun (FSDP2 over --nproc ranks); publish every version as "
        "an event + S3 checkpoint."
    ),
    "rollout": "Drive real browsers through a task suite with a policy; every step goes to the event log.",
    "sft": "Behaviour cloning of the policy on the successful trajectories of demonstration runs.",
    "eval": (
        "Held-out success rate with a 95% (Wilson) confidence interval; with --models, a paired evaluation: "
        "every model on the same instances, and each one's difference to the first with a bootstrap "
        "interval clustered by instance."
    ),
}
"""Each verb's help; its flags come from its command object (`app.configs.COMMANDS`)."""
_COMMAND = "awrl.command"
"""Where `ConfigVerb` leaves the parsed command object (`click.Context.meta`)."""


def parse_verb(verb: str, args: list[str]):
    """The command object of a verb from its arguments (`app.configs.parse`; imports torch on use)."""
    from app.configs import COMMANDS, parse

    return parse(COMMANDS[verb], args, f"awrl {verb}", CONFIG_VERBS[verb])


class ConfigVerb(typer.core.TyperCommand):
    """A verb parsed by tyro: a usage error (`ConfigError`) or `--help` (exit 0) happens while click
    makes the verb's context, so `cli.check_args` checks these verbs like any other."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.meta[_COMMAND] = parse_verb(self.name, args)
        return super().parse_args(ctx, [])


def command_of(ctx: typer.Context):
    """The verb's command object, as `ConfigVerb` parsed it."""
    return ctx.meta[_COMMAND]


def demo(ctx: typer.Context) -> None:
    from analysis.browse import page_url
    from app.demo import run_demo
    from app.stacks import find_or_start

    cmd = command_of(ctx)
    settings, stack, started = find_or_start(cmd.data_dir, console.status)
    try:
        summary = run_demo(settings, cmd.learning, say=console.print)
    finally:
        if started and not cmd.keep:
            stack.down()
    emit_record(vars(summary), cmd.format, title=f"demo run {summary.run_id}")
    if cmd.format is Format.table:
        console.print(
            f"next: [bold]dagster dev[/] (the run is partition {summary.run_id}), "
            f"[bold]awrl runs[/], [bold]awrl drift {summary.run_id}[/], "
            f"[bold]awrl replay {summary.run_id}[/], [bold]awrl stack down[/] when done"
        )
        console.print(
            f"see it: [bold]awrl view[/], then {page_url(settings.viewer_url, summary.run_id)}", soft_wrap=True
        )
    if summary.events_in_ledger == 0:
        raise fail("the run did not reach the ledger", 1)


def run(ctx: typer.Context) -> None:
    from rich.live import Live

    from analysis.browse import page_url
    from app.stacks import find_or_start
    from app.training import run_training

    cmd = command_of(ctx)
    config = cmd.run
    settings, _, _ = find_or_start(cmd.data_dir, console.status)
    with Live(console=console, refresh_per_second=2, transient=cmd.format is not Format.table) as live:

        def show(p) -> None:
            elapsed = time.monotonic() - p.started
            live.update(
                f"[bold]{config.mode}[/] {elapsed / 60:4.1f}/{config.minutes:g} min  trajectories "
                f"{p.episodes:,}  success {p.successes / max(p.episodes, 1):.2f}  policy v{p.version}  "
                f"staleness {p.staleness:.2f}  dropped {p.dropped}  trainer idle {p.trainer_idle:.0%}"
                + (f"\n[yellow]{p.status}[/]" if p.status else "")
            )

        summary = run_training(settings, config, on_progress=show)
    emit_record(
        {**vars(summary), "trajectories_per_hour": summary.trajectories_per_hour},
        cmd.format,
        title=f"run {summary.run_id}",
    )
    if cmd.format is Format.table:
        console.print(
            f"see it: [bold]awrl view[/], then {page_url(settings.viewer_url, summary.run_id)}", soft_wrap=True
        )


def train(ctx: typer.Context) -> None:
    from app.training import record_start
    from pipeline.bus import EventProducer
    from pipeline.settings import StackSettings
    from trainer.launch import launch

    cmd = command_of(ctx)
    nodes = cmd.nodes
    if not cmd.train.run_id:
        raise fail("--run-id is required (or AWRL_RUN_ID): the run whose groups to train on")
    if problem := nodes.problem():
        raise fail(problem)
    if nodes.node_rank == 0:  # the run's start is recorded once, by the node that holds rank 0
        settings = StackSettings()
        producer = EventProducer(settings, client_id="train")
        try:
            record_start(producer, cmd.train.run_id, "train", cmd.train)
        finally:
            producer.close()
    raise typer.Exit(launch(cmd.train, cmd.nproc, nodes=nodes))


def rollout(ctx: typer.Context) -> None:
    from pipeline.settings import StackSettings
    from rollout.run import run_rollout
    from trainer.staleness import StalenessBudget

    cmd = command_of(ctx)
    req = replace(cmd.rollout, episodes=None) if cmd.forever else cmd.rollout
    _require_model_dir(req.model_dir)
    budget = None if cmd.eta is None else StalenessBudget(cmd.eta, cmd.groups_per_update)
    stats = run_rollout(StackSettings(), req, admission=budget)
    emit_record(
        {
            "episodes": stats.episodes,
            "success": stats.successes / max(stats.episodes, 1),
            "env_errors": stats.env_errors,
            "judge_errors": stats.judge_errors,
            "steps": stats.steps,
            "steps_per_s": stats.steps_per_s,
        },
        cmd.format,
    )


def sft(ctx: typer.Context) -> None:
    from rich.progress import Progress

    from analysis import connect
    from analysis.runs import require_run
    from pipeline.settings import StackSettings
    from trainer.sft import train_sft

    cmd = command_of(ctx)
    config = cmd.sft
    if not config.run_ids:
        raise fail("--run-ids is required: the demonstration run(s) in the ledger")
    _require_model_dir(config.model_dir)
    settings = StackSettings()
    con = connect(settings)
    for run in config.run_ids:
        require_run(con, run)
    with Progress(console=console, transient=True, disable=not console.is_terminal) as progress:
        task = progress.add_task("sft", total=None)
        result = train_sft(
            settings,
            config,
            on_step=lambda i, n, loss: progress.update(task, completed=i, total=n, description=f"sft  loss {loss:.3f}"),
        )
    emit_record(
        {
            "demonstration_steps": result.demonstrations,
            "loss_first": result.losses[0],
            "loss_last": result.losses[-1],
            "model_dir": str(result.out_dir),
        },
        cmd.format,
    )


def evaluate(ctx: typer.Context) -> None:
    from pipeline.settings import StackSettings
    from rollout.evaluate import evaluate as run_eval

    cmd = command_of(ctx)
    c = cmd.evaluation
    _require_model_dir(c.model_dir)
    if c.models:
        if c.model_dir is not None or c.policy != "local":
            raise fail("--models evaluates model directories with the local policy: leave out --model-dir and --policy")
        _paired(StackSettings(), c, _paired_policies(c), cmd.format)
        return
    if c.labels or c.model_temperatures:
        raise fail("--labels and --model-temperatures name the --models of a paired evaluation: add --models DIR")
    result = run_eval(
        StackSettings(),
        c.policy,
        c.model_dir,
        c.suite,
        c.split,
        c.difficulty,
        c.episodes,
        c.workers,
        c.som,
        c.temperature,
        run_id=c.run_id,
        templates=c.templates,
    )
    low, high = result.ci95
    emit_record(
        {
            "run_id": result.run_id,
            "episodes": result.episodes,
            "successes": result.successes,
            "success": result.rate,
            "ci95_low": low,
            "ci95_high": high,
        },
        cmd.format,
        title=f"{result.run_id}: success {human(result.rate)} [{human(low)}, {human(high)}]",
    )


def _paired_policies(c) -> list:
    """The `EvalPolicy` of each of `c.models` (an `EvalConfig`), its label and temperature matched by position."""
    from rollout.evaluate import EvalPolicy, run_label

    models, labels, temperatures = list(c.models), list(c.labels), list(c.model_temperatures)
    for flag, given in (("--labels", labels), ("--model-temperatures", temperatures)):
        if given and len(given) != len(models):
            raise fail(
                f"{len(given)} {flag} for {len(models)} --models: give one for each of --models, in order, or none"
            )
    for m in models:
        _require_model_dir(m, "--models")
    temperatures = temperatures or [c.temperature] * len(models)
    if not labels:  # the folder's name; the temperature too where a folder comes twice
        names = [m.name for m in models]
        labels = [n if names.count(n) == 1 else f"{n}-t{t:g}" for n, t in zip(names, temperatures)]
    runs = [run_label(x) for x in labels]
    if len(set(runs)) < len(runs):
        raise fail(f"--labels: each of --models needs a label of its own, got {', '.join(labels)}")
    return [EvalPolicy(x, m, t) for x, m, t in zip(labels, models, temperatures)]


def _paired(settings, c, policies, fmt: Format) -> None:
    from rollout.evaluate import evaluate_paired, instance_ids

    try:
        instance_ids(c.suite, c.split, c.difficulty, c.templates, c.instances)
    except ValueError as exc:  # no task of the split fits the filters
        raise fail(str(exc)) from None
    paired = evaluate_paired(
        settings,
        policies,
        c.suite,
        c.split,
        c.difficulty,
        c.templates,
        c.instances,
        c.samples,
        c.workers,
        c.som,
        c.run_id,
    )
    rows = []
    for i, p in enumerate(paired.policies):
        total = p.total
        d = p.minus(paired.policies[0]) if i else None
        rows.append(
            [
                p.label,
                p.temperature,
                total.episodes,
                total.successes,
                total.rate,
                *total.ci95,
                p.invalid_share,
                p.env_errors,
                *((d.diff, *d.ci95) if d else (None, None, None)),
                p.run_id,
            ]
        )
    columns = [
        "policy",
        "temperature",
        "episodes",
        "successes",
        "success",
        "ci95_low",
        "ci95_high",
        "invalid_actions",
        "env_errors",
        "minus_first",
        "minus_first_low",
        "minus_first_high",
        "run_id",
    ]
    emit_rows(
        columns,
        rows,
        fmt,
        title=(
            f"{paired.run_id}: {len(paired.task_ids)} instances x {c.samples} episodes, {c.suite} {c.split} "
            f"{c.difficulty or ''} (success: Wilson 95%; minus first: paired bootstrap 95% over instances)"
        ),
    )


def _require_model_dir(model_dir: Path | None, flag: str = "--model-dir") -> None:
    if model_dir is not None and not (model_dir / "config.json").is_file():
        raise fail(f"{flag} {model_dir}: not an HF model directory (no config.json)")


def register(app: typer.Typer) -> None:
    """Add the verbs that run something to the main `awrl` CLI."""
    for verb, function in (
        ("demo", demo),
        ("run", run),
        ("train", train),
        ("rollout", rollout),
        ("sft", sft),
        ("eval", evaluate),
    ):
        app.command(verb, cls=ConfigVerb, help=f"{CONFIG_VERBS[verb]} Flags: `awrl {verb} --help`.", **RAW)(function)
