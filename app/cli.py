"""`awrl`: one command, a verb per job.

Each verb imports its machinery (torch, Playwright, Dagster, the stack) inside its function: the one
stated reason for imports inside functions here and in `app.analysis_cli`, so that `awrl --help` and
a mistyped option answer at once instead of after seconds of loading.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Literal

import typer
from rich.console import Console
from rich.table import Table

from app.analysis_cli import register as register_analysis
from schemas.observation import Difficulty, PolicyName, Split, SuiteName

# Choices whose own types live in modules too heavy to import for `--help` (torch): tests/test_cli.py
# checks that they equal `RunConfig.mode`, `TrainConfig.loss` and `GRPOConfig.normalizer`.
Mode = Literal["async", "sync"]
Loss = Literal["grpo", "raft"]
Normalizer = Literal["per_trajectory", "constant", "token"]

app = typer.Typer(help="AsyncWebRL: event-sourced asynchronous multi-step RL for visual web agents.",
                  no_args_is_help=True, pretty_exceptions_enable=False)
stack_app = typer.Typer(help="The embedded local stack: Kafka-protocol broker + S3 store on 127.0.0.1.",
                        no_args_is_help=True)
app.add_typer(stack_app, name="stack")
console = Console()

DATA_DIR = typer.Option(Path(os.environ.get("AWRL_DATA_DIR", ".awrl/stack")), "--data-dir",
                        help="Where the stack keeps its data, logs and PID record.")


def _fail(message: str) -> None:
    console.print(f"[bold red]error:[/] {message}")
    raise typer.Exit(1)


@stack_app.command("up")
def stack_up(
    data_dir: Path = DATA_DIR,
    durable: bool = typer.Option(True, "--durable/--ephemeral",
                                 help="Object store on a file that survives restarts, or in memory."),
    kafka_port: int = typer.Option(None, help="Broker port (default: a free one)."),
    s3_port: int = typer.Option(None, help="S3 port (default: a free one)."),
    dotenv: Path = typer.Option(Path(".env"), help="Also write the connection settings here."),
    vllm: Path = typer.Option(None, help="Also serve this HF model directory with vLLM (the policy server of "
                                         "--policy vllm; its environment comes from `make vllm-env`)."),
    vllm_cpus: str = typer.Option(None, help="Cores vLLM's threads bind to, e.g. 0 or 0-1 (default: vLLM's choice)."),
) -> None:
    """Start the stack (or report the running one) and write its settings to .env."""
    from pipeline.stack.local import LocalStack
    from pipeline.stack.process import StackError
    from pipeline.stack.vllm import VLLMServerConfig

    server = VLLMServerConfig(model_dir=vllm, cpus=vllm_cpus) if vllm is not None else None
    what = "broker, S3 store and vLLM (about 80 s)" if server else "Kafka-protocol broker and S3 store"
    try:
        with console.status(f"starting {what} ..."):
            stack = LocalStack.up(data_dir, durable=durable, kafka_port=kafka_port, s3_port=s3_port, vllm=server)
    except StackError as exc:
        _fail(str(exc))
    if not stack.write_dotenv(dotenv):
        console.print(f"[yellow]{dotenv} exists and was not written by awrl; left it alone.[/] "
                      f"Settings are in {data_dir / 'stack.env'}")
    _print_status(stack)


@stack_app.command("down")
def stack_down(data_dir: Path = DATA_DIR) -> None:
    """Stop exactly the processes `stack up` started."""
    from pipeline.stack.local import LocalStack

    stack = LocalStack.load(data_dir)
    if stack is None:
        console.print("no stack running from " + str(data_dir))
        return
    stack.down()
    console.print(f"stopped {data_dir}")


@stack_app.command("status")
def stack_status(data_dir: Path = DATA_DIR) -> None:
    """Each service, its port, PID and health; exit 1 if any is unhealthy."""
    from pipeline.stack.local import LocalStack

    stack = LocalStack.load(data_dir)
    if stack is None:
        _fail("no stack running from " + str(data_dir))
    if not _print_status(stack):
        raise typer.Exit(1)


def _print_status(stack) -> bool:
    health = stack.health()
    table = Table(title=f"stack in {stack.data_dir}")
    for col in ("service", "port", "pid", "health"):
        table.add_column(col)
    for s in stack.services:
        ok = health.get(s.name, False)
        table.add_row(s.name, str(s.port or "-"), str(s.pid), "[green]up[/]" if ok else "[red]down[/]")
    console.print(table)
    console.print(f"kafka {stack.kafka_bootstrap}   s3 http://{stack.s3.endpoint}   bucket {stack.bucket}"
                  + (f"   vllm {stack.vllm_url} ({stack.vllm_model})" if stack.vllm_url else ""))
    return all(health.values())


@app.command()
def demo(
    data_dir: Path = DATA_DIR,
    suite: SuiteName = typer.Option("miniwob", help="Task suite (Easy tasks): miniwob (learns on CPU) or sites."),
    demo_episodes: int = typer.Option(100, help="Oracle demonstration episodes for the SFT warm start."),
    sft_epochs: int = typer.Option(4),
    rl_minutes: float = typer.Option(5.0, help="Wall budget of the async RL stage."),
    eval_episodes: int = typer.Option(64, help="Held-out episodes per evaluation (Wilson 95% intervals of about "
                                               "+-0.12; bench/learning.py uses 200)."),
    workers: int = typer.Option(2, help="Browsers in the pool."),
    keep: bool = typer.Option(True, help="Leave the stack running for `dagster dev` and `awrl sql`."),
) -> None:
    """The main job on the local stack: demonstrations -> SFT -> async RL -> ledger -> drift -> Dagster,
    with held-out success before and after."""
    from app.demo import run_demo
    from app.learning import LearningConfig
    from pipeline.stack.local import LocalStack

    already = LocalStack.load(data_dir)
    with console.status("starting the local stack ..."):
        stack = LocalStack.up(data_dir)
    # This process and a later `dagster dev` read the stack from the same settings.
    os.environ.update(dict(line.split("=", 1) for line in stack.dotenv().splitlines()[1:]))
    stack.write_dotenv(Path(".env"))
    config = LearningConfig(suite=suite, demo_episodes=demo_episodes, sft_epochs=sft_epochs, rl_minutes=rl_minutes,
                            eval_episodes=eval_episodes, workers=workers, out_dir=Path(".awrl/learning"))
    try:
        summary = run_demo(stack.settings(), config, say=console.print)
    finally:
        if not keep and already is None:
            stack.down()
    table = Table(title=f"demo run {summary.run_id}")
    table.add_column("what")
    table.add_column("value", justify="right")
    for k, v in vars(summary).items():
        if k != "run_id":
            table.add_row(k.replace("_", " "), f"{v:.3f}" if isinstance(v, float) else str(v))
    console.print(table)
    console.print(f"next: [bold]dagster dev[/] (reads .env; the run is partition {summary.run_id}), "
                  f"[bold]awrl sql \"SELECT * FROM evaluations\"[/], [bold]awrl drift {summary.run_id}[/], "
                  f"[bold]awrl stack down[/] when done")
    if summary.events_in_ledger == 0:
        _fail("the run did not reach the ledger")


register_analysis(app)

ledger_app = typer.Typer(help="The Parquet ledger: every event of every run, exactly once.", no_args_is_help=True)
app.add_typer(ledger_app, name="ledger")


@ledger_app.command("sync")
def ledger_sync(
    follow: bool = typer.Option(False, help="Keep writing as events arrive (until interrupted)."),
    ledger_uri: str = typer.Option(None, help="Override AWRL_LEDGER_URI (s3://bucket/prefix or a directory)."),
) -> None:
    """Consume every event topic into Parquet, exactly once (offsets committed after the files are
    durable; the ledger's journal names what an uncommitted flush wrote). For N writers, run this
    N times: they share the partitions as one consumer group, and take over a dead one's."""
    from pipeline.ledger import LedgerWriter
    from pipeline.settings import StackSettings

    settings = StackSettings()
    if ledger_uri:
        settings = settings.model_copy(update={"ledger_uri": ledger_uri})
    writer = LedgerWriter(settings)
    with console.status(f"writing {settings.ledger_uri} ...") as status:
        stats = writer.sync(follow=follow, on_flush=lambda s: status.update(
            f"{s.written} events in {s.files} files, {s.duplicates} duplicates skipped, max lag {s.max_lag_s:.2f}s"))
    console.print(f"{stats.written} events written in {stats.files} files ({stats.bytes / 1e6:.1f} MB), "
                  f"{stats.duplicates} duplicates skipped, max lag {stats.max_lag_s:.2f}s")


@ledger_app.command("compact")
def ledger_compact(
    run_id: list[str] = typer.Option(..., "--run-id", help="Run(s) whose small files to merge (repeatable)."),
    ledger_uri: str = typer.Option(None, help="Override AWRL_LEDGER_URI (s3://bucket/prefix or a directory)."),
) -> None:
    """Merge runs' small event files into large sorted ones (what the Dagster `compaction` asset does);
    safe while writers and queries run."""
    from pipeline.ledger import compact_ledger
    from pipeline.settings import StackSettings

    settings = StackSettings()
    if ledger_uri:
        settings = settings.model_copy(update={"ledger_uri": ledger_uri})
    for run in run_id:
        with console.status(f"compacting {run} ..."):
            results = compact_ledger(settings, run)
        for event_type, r in sorted(results.items()):
            console.print(f"{run} {event_type}: {r.files_before} -> {r.files_after} files ({r.rows} rows merged, "
                          f"{r.deleted} superseded files deleted)")


@app.command()
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
    model_dir: Path = typer.Option(None, help="HF model directory for --policy local."),
    vllm_url: str = typer.Option(None, help="OpenAI-compatible vLLM server for --policy vllm."),
    eta: int = typer.Option(None, help="Staleness bound: dispatch only what a trainer with this eta can use."),
    groups_per_update: int = typer.Option(4, help="The trainer's groups per update (with --eta)."),
    seed: int = typer.Option(0),
    journal: Path = typer.Option(Path(".awrl/rollout-journal"), envvar="AWRL_ROLLOUT_JOURNAL",
                                 help="Open-episode journals of this host's pools (a killed pool's episodes "
                                      "are ended as env_error by the next pool)."),
) -> None:
    """Drive real browsers through a task suite with a policy; every step goes to the event log."""
    from pipeline.settings import StackSettings
    from rollout.episode import EpisodeConfig
    from rollout.run import RolloutRequest, run_rollout
    from trainer.staleness import StalenessBudget

    req = RolloutRequest(suite=suite, policy=policy, workers=workers, group_size=group_size,
                         episodes=None if forever else episodes, dispatch=dispatch, split=split,
                         difficulty=difficulty,
                         run_id=run_id, seed=seed, model_dir=model_dir, vllm_url=vllm_url,
                         episode=EpisodeConfig(som=som), noise=noise, journal_dir=journal)
    budget = None if eta is None else StalenessBudget(eta, groups_per_update)
    stats = run_rollout(StackSettings(), req, admission=budget)
    console.print(f"episodes {stats.episodes}  success {stats.successes / max(stats.episodes, 1):.3f}  "
                  f"env_errors {stats.env_errors}  steps {stats.steps}  steps/s {stats.steps_per_s:.2f}")



@app.command()
def train(
    run_id: str = typer.Option(..., envvar="AWRL_RUN_ID", help="The run whose groups to train on."),
    nproc: int = typer.Option(1, help="Trainer processes (torchrun --nproc_per_node)."),
    model_dir: Path = typer.Option(None, help="Initial HF model directory (default: the tiny VLM)."),
    loss: Loss = typer.Option("grpo", help="grpo (decoupled PPO, group advantages) or raft (RAFT++)."),
    normalizer: Normalizer = typer.Option("constant", help="Multi-step GRPO normaliser: constant, per_trajectory, token."),
    groups_per_update: int = typer.Option(4, help="Task groups per optimizer step."),
    eta: int = typer.Option(2, help="Staleness bound in versions."),
    lr: float = typer.Option(1e-4),
    minibatches: int = typer.Option(1, help="Optimizer steps per batch."),
    entropy_coef: float = typer.Option(0.0),
    kl_coef: float = typer.Option(0.0, help="beta of the KL penalty to version 0 (the SFT model)."),
    max_updates: int = typer.Option(None, help="Stop after this many optimizer steps."),
    batch_timeout: float = typer.Option(None, help="Stop when no batch arrives for this many seconds."),
    slow_s: float = typer.Option(0.0, help="Extra seconds per update (to study a slow trainer)."),
    activation_checkpointing: bool = typer.Option(False, help="Recompute block activations in backward (less memory)."),
) -> None:
    """Train on a live run's events with torchrun (FSDP2 over --nproc ranks); publish every version as an
    event + S3 checkpoint."""
    from trainer.config import TrainConfig
    from trainer.launch import launch
    from trainer.losses import GRPOConfig

    config = TrainConfig(run_id=run_id, model_dir=model_dir, loss=loss, grpo=GRPOConfig(normalizer=normalizer),
                         groups_per_update=groups_per_update, eta=eta, lr=lr, minibatches=minibatches,
                         entropy_coef=entropy_coef, kl_coef=kl_coef, max_updates=max_updates,
                         batch_timeout_s=batch_timeout, slow_s=slow_s,
                         activation_checkpointing=activation_checkpointing)
    raise typer.Exit(launch(config, nproc))



@app.command()
def sft(
    run_id: list[str] = typer.Option(..., "--run-id", help="Demonstration run(s) in the ledger (repeatable)."),
    out: Path = typer.Option(Path(".awrl/models/sft"), help="Where the warm-started model directory goes."),
    model_dir: Path = typer.Option(None, help="Initial model (default: the tiny VLM)."),
    epochs: int = typer.Option(3),
    lr: float = typer.Option(1e-3),
    batch_steps: int = typer.Option(16, help="Demonstration steps per optimizer step."),
) -> None:
    """Behaviour cloning of the policy on the successful trajectories of demonstration runs."""
    from rich.progress import Progress

    from pipeline.settings import StackSettings
    from trainer.sft import SFTConfig, train_sft

    config = SFTConfig(run_ids=run_id, out_dir=out, model_dir=model_dir, epochs=epochs, lr=lr, batch_steps=batch_steps)
    with Progress(console=console) as progress:
        task = progress.add_task("sft", total=None)
        result = train_sft(StackSettings(), config, on_step=lambda i, n, loss: progress.update(
            task, completed=i, total=n, description=f"sft  loss {loss:.3f}"))
    console.print(f"{result.demonstrations} demonstration steps, loss {result.losses[0]:.3f} -> "
                  f"{result.losses[-1]:.3f}; model in {result.out_dir}")



@app.command("eval")
def evaluate(
    policy: PolicyName = typer.Option("local", help="Policy backend (see rollout)."),
    model_dir: Path = typer.Option(None, help="HF model directory for --policy local."),
    suite: SuiteName = typer.Option("sites"),
    split: Split = typer.Option("heldout"),
    difficulty: Difficulty | None = typer.Option("easy"),
    episodes: int = typer.Option(100),
    workers: int = typer.Option(2),
    som: bool = typer.Option(True, help="Set-of-Mark observations."),
    temperature: float = typer.Option(1.0, help="Sampling temperature (independent episodes need > 0)."),
) -> None:
    """Held-out success rate with a 95% (Wilson) confidence interval."""
    from pipeline.settings import StackSettings
    from rollout.evaluate import evaluate as run_eval

    result = run_eval(StackSettings(), policy, model_dir, suite, split, difficulty, episodes, workers, som, temperature)
    console.print(f"{result.run_id}: {result}")



@app.command("run")
def training_run(
    mode: Mode = typer.Option("async", help="async (AsyncWebRL) or sync (WebGym's schedule)."),
    minutes: float = typer.Option(10.0, help="Wall budget for rollout + training."),
    suite: SuiteName = typer.Option("sites"),
    difficulty: Difficulty | None = typer.Option("easy"),
    policy: PolicyName = typer.Option("local", help="local (the model samples in this process), vllm (the policy "
                                                    "server samples and reloads each version in place) or demo "
                                                    "(oracle actions as the model's tokens)."),
    noise: float = typer.Option(0.0, help="demo policy: random-action probability."),
    model_dir: Path = typer.Option(None, help="Initial weights (e.g. `awrl sft`'s output)."),
    vllm_url: str = typer.Option(None, help="--policy vllm: the server (default AWRL_VLLM_URL, which "
                                            "`awrl stack up --vllm` sets)."),
    workers: int = typer.Option(2),
    group_size: int = typer.Option(2, "--group-size", "-g"),
    groups_per_update: int = typer.Option(2),
    eta: int = typer.Option(2, help="Staleness bound (async)."),
    nproc: int = typer.Option(1, help="Trainer processes."),
    lr: float = typer.Option(1e-4),
    curriculum: bool = typer.Option(False, help="Draw the task families whose recent success is in [0.1, 0.9]."),
    curriculum_from: list[str] = typer.Option([], help="Earlier runs whose ledgered outcomes seed the curriculum."),
    data_dir: Path = DATA_DIR,
) -> None:
    """A training run: stack (started if needed), rollout pool, ledger writer and trainer, live progress."""
    from rich.live import Live

    from app.training import RunConfig, run_training
    from pipeline.stack.local import LocalStack
    from rollout.curriculum import CurriculumConfig
    from rollout.episode import EpisodeConfig
    from rollout.run import RolloutRequest
    from trainer.config import TrainConfig

    with console.status("starting the local stack ..."):
        stack = LocalStack.up(data_dir)
    os.environ.update(stack.settings().environ())
    rollout = RolloutRequest(suite=suite, difficulty=difficulty, policy=policy, noise=noise, model_dir=model_dir,
                             vllm_url=vllm_url, workers=workers, group_size=group_size, episode=EpisodeConfig(som=True),
                             curriculum=CurriculumConfig() if curriculum else None,
                             curriculum_from=tuple(curriculum_from))
    config = RunConfig(mode=mode, minutes=minutes, rollout=rollout, eta=eta, nproc=nproc,
                       train=TrainConfig(run_id="-", groups_per_update=groups_per_update, lr=lr))
    with Live(console=console, refresh_per_second=2) as live:
        def show(p) -> None:
            elapsed = time.monotonic() - p.started
            live.update(f"[bold]{mode}[/] {elapsed / 60:4.1f}/{minutes:g} min  trajectories {p.episodes}  "
                        f"success {p.successes / max(p.episodes, 1):.2f}  policy v{p.version}  "
                        f"staleness {p.staleness:.2f}  dropped {p.dropped}  trainer idle {p.trainer_idle:.0%}")

        summary = run_training(stack.settings(), config, on_progress=show)
    table = Table(title=f"run {summary.run_id}")
    table.add_column("what")
    table.add_column("value", justify="right")
    for k, v in [*vars(summary).items(), ("trajectories_per_hour", summary.trajectories_per_hour)]:
        table.add_row(k.replace("_", " "), f"{v:.3f}" if isinstance(v, float) else str(v))
    console.print(table)


if __name__ == "__main__":
    app()
