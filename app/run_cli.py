"""`awrl demo | run | train | rollout | sft | eval`: the verbs that run something.

`demo`, `run` and `train` take their flags from their config objects (`app.configs`: every field is a
flag, `--config FILE|NAME` loads a whole config first); they pass their raw arguments to tyro, so
their `--help` is tyro's. `rollout`, `sft` and `eval` are small typer verbs over a few options.
"""

from __future__ import annotations

import time
from pathlib import Path

import typer

from app.output import FORMAT, Format, console, emit_record, emit_rows, fail, human
from schemas.observation import Difficulty, PolicyName, Split, SuiteName

RAW = {"context_settings": {"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []},
       "add_help_option": False}
"""Typer hands every argument to the verb, which parses them with tyro (`app.configs.parse`)."""

CONFIG_VERBS: dict[str, str] = {
    "demo": ("The main job on the local stack: demonstrations -> SFT -> async RL -> ledger -> drift -> Dagster, "
             "with held-out success before and after."),
    "run": ("A training run: the stack (started if needed), the rollout pool, the ledger writer and the "
            "torchrun trainer, with live progress."),
    "train": ("Train on a live run's events with torchrun (FSDP2 over --nproc ranks); publish every version as "
              "an event + S3 checkpoint."),
}
"""The verbs whose flags come from their config objects (`app.configs.COMMANDS`), with their help."""


def parse_args(verb: str, args: list[str]):
    """The command object of a config-derived verb (`app.configs.parse`; imports torch on use)."""
    from app.configs import COMMANDS, parse

    return parse(COMMANDS[verb], args, f"awrl {verb}", CONFIG_VERBS[verb])


def demo(ctx: typer.Context) -> None:
    from analysis.browse import page_url
    from app.demo import run_demo
    from app.stacks import find_or_start

    cmd = parse_args("demo", ctx.args)
    settings, stack, started = find_or_start(cmd.data_dir, console.status)
    try:
        summary = run_demo(settings, cmd.learning, say=console.print)
    finally:
        if started and not cmd.keep:
            stack.down()
    emit_record(vars(summary), cmd.format, title=f"demo run {summary.run_id}")
    if cmd.format is Format.table:
        console.print(f"next: [bold]dagster dev[/] (the run is partition {summary.run_id}), "
                      f"[bold]awrl runs[/], [bold]awrl drift {summary.run_id}[/], "
                      f"[bold]awrl replay {summary.run_id}[/], [bold]awrl stack down[/] when done")
        console.print(f"see it: [bold]awrl view[/], then {page_url(settings.viewer_url, summary.run_id)}",
                      soft_wrap=True)
    if summary.events_in_ledger == 0:
        raise fail("the run did not reach the ledger", 1)


def run(ctx: typer.Context) -> None:
    from rich.live import Live

    from analysis.browse import page_url
    from app.stacks import find_or_start
    from app.training import run_training

    cmd = parse_args("run", ctx.args)
    config = cmd.run
    settings, _, _ = find_or_start(cmd.data_dir, console.status)
    with Live(console=console, refresh_per_second=2, transient=cmd.format is not Format.table) as live:
        def show(p) -> None:
            elapsed = time.monotonic() - p.started
            live.update(f"[bold]{config.mode}[/] {elapsed / 60:4.1f}/{config.minutes:g} min  trajectories "
                        f"{p.episodes:,}  success {p.successes / max(p.episodes, 1):.2f}  policy v{p.version}  "
                        f"staleness {p.staleness:.2f}  dropped {p.dropped}  trainer idle {p.trainer_idle:.0%}"
                        + (f"\n[yellow]{p.status}[/]" if p.status else ""))

        summary = run_training(settings, config, on_progress=show)
    emit_record({**vars(summary), "trajectories_per_hour": summary.trajectories_per_hour}, cmd.format,
                title=f"run {summary.run_id}")
    if cmd.format is Format.table:
        console.print(f"see it: [bold]awrl view[/], then {page_url(settings.viewer_url, summary.run_id)}",
                      soft_wrap=True)


def train(ctx: typer.Context) -> None:
    from app.training import record_start
    from pipeline.bus import EventProducer
    from pipeline.settings import StackSettings
    from trainer.launch import launch

    cmd = parse_args("train", ctx.args)
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


def rollout(
    suite: SuiteName = typer.Option("sites", help="Task suite: sites (our multi-page sites), miniwob or boxes."),
    policy: PolicyName = typer.Option("oracle", help="Policy backend: oracle, random, local, vllm, demo (oracle "
                                              "actions as the local model's tokens)."),
    noise: float = typer.Option(0.0, help="demo policy: probability of a random action per step."),
    workers: int = typer.Option(4, help="Browsers kept alive in this process."),
    group_size: int = typer.Option(4, "--group-size", "-g", help="Episodes per task group (GRPO's G)."),
    episodes: int = typer.Option(16, help="Stop after this many episodes (whole groups)."),
    forever: bool = typer.Option(False, help="Run until interrupted (overrides --episodes)."),
    dispatch: bool = typer.Option(True, help="Also dispatch task groups (off when a dispatcher runs elsewhere)."),
    som: bool = typer.Option(False, help="Set-of-Mark observations instead of pure pixels."),
    split: Split = typer.Option("train", help="Task split to dispatch."),
    difficulty: Difficulty | None = typer.Option(None, help="Dispatch only tasks of this difficulty."),
    run_id: str = typer.Option("", envvar="AWRL_RUN_ID", help="Run id (default: a new one)."),
    model_dir: Path = typer.Option(None, help="HF model directory: --policy local's weights; with --policy vllm, "
                                              "reloaded into the server as version 0."),
    vllm_url: str = typer.Option(None, help="OpenAI-compatible vLLM server for --policy vllm."),
    eta: int = typer.Option(None, help="Staleness bound: dispatch only what a trainer with this eta can use."),
    groups_per_update: int = typer.Option(4, help="The trainer's groups per update (with --eta)."),
    seed: int = typer.Option(0),
    max_batch: int = typer.Option(64, min=1, help="--policy local: most waiting prompts decoded together "
                                                  "(1: each alone)."),
    journal: Path = typer.Option(Path(".awrl/rollout-journal"), envvar="AWRL_ROLLOUT_JOURNAL",
                                 help="Open-episode journals of this host's pools (a killed pool's episodes "
                                      "are ended as env_error by the next pool)."),
    format: Format = FORMAT,  # noqa: A002 - the option's name
) -> None:
    """Drive real browsers through a task suite with a policy; every step goes to the event log."""
    from pipeline.settings import StackSettings
    from rollout.episode import EpisodeConfig
    from rollout.run import RolloutRequest, run_rollout
    from trainer.staleness import StalenessBudget

    _require_model_dir(model_dir)
    req = RolloutRequest(suite=suite, policy=policy, workers=workers, group_size=group_size,
                         episodes=None if forever else episodes, dispatch=dispatch, split=split,
                         difficulty=difficulty, run_id=run_id, seed=seed, model_dir=model_dir, vllm_url=vllm_url,
                         episode=EpisodeConfig(som=som), noise=noise, journal_dir=journal, max_batch=max_batch)
    budget = None if eta is None else StalenessBudget(eta, groups_per_update)
    stats = run_rollout(StackSettings(), req, admission=budget)
    emit_record({"episodes": stats.episodes, "success": stats.successes / max(stats.episodes, 1),
                 "env_errors": stats.env_errors, "steps": stats.steps, "steps_per_s": stats.steps_per_s}, format)


def sft(
    run_id: list[str] = typer.Option(..., "--run-id", help="Demonstration run(s) in the ledger (repeatable)."),
    out: Path = typer.Option(Path(".awrl/models/sft"), help="Where the warm-started model directory goes."),
    model_dir: Path = typer.Option(None, help="Initial model (default: the tiny VLM)."),
    epochs: int = typer.Option(3),
    lr: float = typer.Option(1e-3),
    batch_steps: int = typer.Option(16, help="Demonstration steps per optimizer step."),
    format: Format = FORMAT,  # noqa: A002 - the option's name
) -> None:
    """Behaviour cloning of the policy on the successful trajectories of demonstration runs."""
    from rich.progress import Progress

    from analysis import connect
    from analysis.runs import require_run
    from pipeline.settings import StackSettings
    from trainer.sft import SFTConfig, train_sft

    _require_model_dir(model_dir)
    settings = StackSettings()
    con = connect(settings)
    for run in run_id:
        require_run(con, run)
    config = SFTConfig(run_ids=run_id, out_dir=out, model_dir=model_dir, epochs=epochs, lr=lr, batch_steps=batch_steps)
    with Progress(console=console, transient=True, disable=not console.is_terminal) as progress:
        task = progress.add_task("sft", total=None)
        result = train_sft(settings, config, on_step=lambda i, n, loss: progress.update(
            task, completed=i, total=n, description=f"sft  loss {loss:.3f}"))
    emit_record({"demonstration_steps": result.demonstrations, "loss_first": result.losses[0],
                 "loss_last": result.losses[-1], "model_dir": str(result.out_dir)}, format)


def evaluate(
    policy: PolicyName = typer.Option("local", help="Policy backend (see rollout)."),
    model_dir: Path = typer.Option(None, help="HF model directory for --policy local."),
    suite: SuiteName = typer.Option("sites"),
    split: Split = typer.Option("heldout"),
    difficulty: Difficulty | None = typer.Option("easy"),
    episodes: int = typer.Option(100, help="Independent episodes (without --model)."),
    workers: int = typer.Option(2),
    som: bool = typer.Option(True, help="Set-of-Mark observations."),
    temperature: float = typer.Option(1.0, help="Sampling temperature (independent episodes need > 0)."),
    model: list[Path] = typer.Option(None, "--model", help="Paired evaluation: a model directory (repeat it for "
                                                              "each policy); every one runs the same instances."),
    label: list[str] = typer.Option(None, "--label", help="Name of each --model, in order (default: its folder)."),
    model_temperature: list[float] = typer.Option(None, "--model-temperature",
                                                  help="Temperature of each --model, in order (default: "
                                                       "--temperature)."),
    samples: int = typer.Option(4, min=1, help="--model: episodes per instance."),
    instances: int = typer.Option(None, min=1, help="--model: the first N instances of a fixed seeded order of "
                                                    "the split (default: all)."),
    run_id: str = typer.Option("", help="Evaluation run id (default: a new one); a --model's episodes are the "
                                        "run <run-id>-<label>."),
    format: Format = FORMAT,  # noqa: A002 - the option's name
) -> None:
    """Held-out success rate with a 95% (Wilson) confidence interval; with --model (repeated), a paired
    evaluation: every model on the same instances, and each one's difference to the first with a
    bootstrap interval clustered by instance."""
    from pipeline.settings import StackSettings
    from rollout.evaluate import evaluate as run_eval

    _require_model_dir(model_dir)
    if model:
        if model_dir is not None or policy != "local":
            raise fail("--model evaluates model directories with the local policy: leave out --model-dir and --policy")
        policies = _paired_policies(model, label or [], model_temperature or [], temperature)
        _paired(StackSettings(), policies, suite, split, difficulty, instances, samples, workers, som, run_id, format)
        return
    if label or model_temperature:
        raise fail("--label and --model-temperature name the --model policies of a paired evaluation: add --model DIR")
    result = run_eval(StackSettings(), policy, model_dir, suite, split, difficulty, episodes, workers, som, temperature,
                      run_id=run_id)
    low, high = result.ci95
    emit_record({"run_id": result.run_id, "episodes": result.episodes, "successes": result.successes,
                 "success": result.rate, "ci95_low": low, "ci95_high": high}, format,
                title=f"{result.run_id}: success {human(result.rate)} [{human(low)}, {human(high)}]")


def _paired_policies(models: list[Path], labels: list[str], temperatures: list[float], temperature: float) -> list:
    """The `EvalPolicy` of each --model, its label and temperature matched by position."""
    from rollout.evaluate import EvalPolicy, run_label

    for flag, given in (("--label", labels), ("--model-temperature", temperatures)):
        if given and len(given) != len(models):
            raise fail(f"{len(given)} {flag} for {len(models)} --model: give one for each --model, in order, or none")
    for m in models:
        _require_model_dir(m, "--model")
    temperatures = temperatures or [temperature] * len(models)
    if not labels:  # the folder's name; the temperature too where a folder comes twice
        names = [m.name for m in models]
        labels = [n if names.count(n) == 1 else f"{n}-t{t:g}" for n, t in zip(names, temperatures)]
    runs = [run_label(x) for x in labels]
    if len(set(runs)) < len(runs):
        raise fail(f"--label: each --model needs a label of its own, got {', '.join(labels)}")
    return [EvalPolicy(x, m, t) for x, m, t in zip(labels, models, temperatures)]


def _paired(settings, policies, suite, split, difficulty, instances, samples, workers, som, run_id,
            fmt: Format) -> None:
    from rollout.evaluate import evaluate_paired, instance_ids

    try:
        instance_ids(suite, split, difficulty, None, instances)
    except ValueError as exc:  # no task of the split fits the filters
        raise fail(str(exc)) from None
    paired = evaluate_paired(settings, policies, suite, split, difficulty, None, instances, samples, workers, som,
                             run_id)
    rows = []
    for i, p in enumerate(paired.policies):
        total = p.total
        d = p.minus(paired.policies[0]) if i else None
        rows.append([p.label, p.temperature, total.episodes, total.successes, total.rate, *total.ci95,
                     p.invalid_share, p.env_errors, *((d.diff, *d.ci95) if d else (None, None, None)), p.run_id])
    columns = ["policy", "temperature", "episodes", "successes", "success", "ci95_low", "ci95_high",
               "invalid_actions", "env_errors", "minus_first", "minus_first_low", "minus_first_high", "run_id"]
    emit_rows(columns, rows, fmt, title=(
        f"{paired.run_id}: {len(paired.task_ids)} instances x {samples} episodes, {suite} {split} "
        f"{difficulty or ''} (success: Wilson 95%; minus first: paired bootstrap 95% over instances)"))


def _require_model_dir(model_dir: Path | None, flag: str = "--model-dir") -> None:
    if model_dir is not None and not (model_dir / "config.json").is_file():
        raise fail(f"{flag} {model_dir}: not an HF model directory (no config.json)")


def register(app: typer.Typer) -> None:
    """Add the verbs that run something to the main `awrl` CLI."""
    for verb, function in (("demo", demo), ("run", run), ("train", train)):
        app.command(verb, help=f"{CONFIG_VERBS[verb]} Flags: `awrl {verb} --help`.", **RAW)(function)
    app.command("rollout")(rollout)
    app.command("sft")(sft)
    app.command("eval")(evaluate)
