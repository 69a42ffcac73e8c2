"""`awrl rejudge RUN` (judge a recorded run again with a model judge, offline) and `awrl agreement A B`
(how well judge A agrees with judge B, per task family)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import typer

from app.analysis_cli import LEDGER, connect_ledger
from app.output import FORMAT, Format, console, emit_rows, fail


def rejudge(
    run_id: str = typer.Argument(..., help="The recorded run to judge again."),
    url: str = typer.Option(..., help="Base URL of an OpenAI-compatible server (the judge)."),
    model: str = typer.Option("", help="The served model's name."),
    screenshots: int = typer.Option(3, help="K: the last K screenshots of each trajectory go with the prompt."),
    attempts: int = typer.Option(3, help="Tries per trajectory before its verdict is a judge_error."),
    prompt_file: Path = typer.Option(None, help="A prompt template ($instruction, $answer, $history, $k)."),
    concurrency: int = typer.Option(4, help="Trajectories judged at once."),
    limit: int = typer.Option(None, help="Judge only the first N trajectories."),
    name: str = typer.Option("rejudged", help="The judge's name in `verdicts` (`awrl agreement NAME rule`)."),
    format: Format = FORMAT,  # noqa: A002 - the option's name
    ledger: str = LEDGER,
) -> None:
    """Judge a recorded run's trajectories again with a model judge, without a browser: each verdict
    is recorded beside the old ones (a `TrajectoryJudged` that gives no reward), then folded into the
    ledger. Compare with `awrl agreement rejudged rule --run RUN` (`--name` names the judge)."""
    from rich.progress import Progress

    from analysis.rejudge import recorded_trajectories
    from analysis.rejudge import rejudge as run
    from pipeline.bus import EventProducer
    from pipeline.ledger import LedgerWriter
    from pipeline.settings import StackSettings
    from pipeline.store import ScreenshotStore
    from rollout.judges import DEFAULT_PROMPT, ModelJudge, ModelJudgeConfig

    try:
        config = ModelJudgeConfig(
            url=url,
            model=model,
            screenshots=screenshots,
            attempts=attempts,
            prompt=prompt_file.read_text() if prompt_file else DEFAULT_PROMPT,
        )
    except (OSError, ValueError) as exc:
        raise fail(str(exc)) from None
    con = connect_ledger(ledger, run_id)
    try:
        trajectories = list(recorded_trajectories(con, run_id))[:limit]
    finally:
        con.close()
    if not trajectories:
        raise fail(f"run {run_id!r} has no finished trajectory to judge")
    settings = StackSettings().with_ledger(ledger)
    store = ScreenshotStore.from_settings(settings)
    events: list = []
    t0 = time.monotonic()
    with Progress(console=console, transient=True, disable=format is not Format.table) as progress:
        task = progress.add_task("judging", total=len(trajectories))
        summary = asyncio.run(
            run(
                trajectories,
                ModelJudge(config),
                lambda hashes: _in_order(store.get_many(hashes), hashes),
                events.append,
                concurrency=concurrency,
                progress=lambda n: progress.update(task, completed=n),
                name=name,
            )
        )
    producer = EventProducer(settings, client_id="rejudge")
    try:
        producer.publish_all(events)
    finally:
        producer.close()
    LedgerWriter(settings).sync(idle_exit_s=3.0)
    summary.seconds = time.monotonic() - t0
    emit_rows(
        ["run_id", "trajectories", "successes", "judge_errors", "seconds"],
        [[summary.run_id, summary.trajectories, summary.successes, summary.judge_errors, round(summary.seconds, 1)]],
        format,
    )
    if format is Format.table:
        console.print(f"next: [bold]awrl agreement {name} rule --run {run_id}[/]")


def _in_order(found: dict[str, bytes], hashes: list[str]) -> list[bytes]:
    """`get_many`'s images, one fetch for all, in the order of `hashes`."""
    return [found[h] for h in hashes]


AGREEMENT = (
    "task_family",
    "trajectories",
    "true_positives",
    "false_positives",
    "false_negatives",
    "true_negatives",
    "accuracy",
    "precision",
    "recall",
    "f1",
)


def agreement(
    judge: str = typer.Argument("model", help="The judge measured."),
    reference: str = typer.Argument("rule", help="The judge taken as the truth."),
    run_id: str = typer.Option(None, "--run", help="One run only; default: every run."),
    format: Format = FORMAT,  # noqa: A002 - the option's name
    ledger: str = LEDGER,
) -> None:
    """How well `judge` agrees with `reference` over the trajectories both judged, per task family:
    confusion counts, accuracy, precision, recall and F1 (`awrl_judge_agreement` in `awrl sql`)."""
    con = connect_ledger(ledger, run_id)
    try:
        rows = con.execute("SELECT * FROM awrl_judge_agreement(?, ?)", [judge, reference]).fetchall()
    finally:
        con.close()
    if not rows or rows[-1][1] == 0:
        raise fail(f"no trajectory was judged by both {judge!r} and {reference!r} (`awrl rejudge` records a judge)")
    emit_rows(list(AGREEMENT), rows, format)


def register(app: typer.Typer) -> None:
    """Add `rejudge` and `agreement` to `app` (the main `awrl` CLI)."""
    app.command("rejudge")(rejudge)
    app.command("agreement")(agreement)
