"""`awrl view` (the trajectory viewer) and `awrl export tensorboard | dataset RUN` (a run taken to the
tools people already use), added to the main CLI by `register(app)`."""

from __future__ import annotations

import errno
import socket
from pathlib import Path

import typer

from app.analysis_cli import LEDGER, connect_ledger
from app.output import console, fail

export_app = typer.Typer(
    help="A run's curves as TensorBoard files, or its steps as a dataset (Parquet with images).", no_args_is_help=True
)


def view(
    host: str = typer.Option(
        "127.0.0.1",
        "--host",
        help="Address to bind; loopback unless told otherwise (the ledger holds every prompt and screenshot).",
    ),
    port: int = typer.Option(8765, "--port", help="TCP port."),
    ledger: str = LEDGER,
) -> None:
    """Serve the trajectory viewer: runs, curves, trajectories step by step with their screenshots,
    groups side by side, updates. Stops with Ctrl-C."""
    from app.viewer import ViewerConfig, serve
    from pipeline.settings import StackSettings

    connect_ledger(ledger).close()  # an unreachable ledger is one line now, not a 500 on every page
    _check_free(host, port)
    settings = StackSettings().with_ledger(ledger)
    console.print(f"awrl view: http://{host}:{port}/ (ledger {settings.ledger_uri}; Ctrl-C stops)")
    serve(settings, ViewerConfig(host=host, port=port))


def _check_free(host: str, port: int) -> None:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError as exc:
            why = (
                "is in use (another `awrl view`?)"
                if exc.errno == errno.EADDRINUSE
                else f"cannot be bound: {exc.strerror}"
            )
            raise fail(f"{host}:{port} {why}; pick another with --port") from None


@export_app.command("tensorboard")
def tensorboard(
    run_id: str = typer.Argument(..., help="The run."),
    out: Path = typer.Option(Path("runs-tb"), "--out", help="Directory; the run's event files go to OUT/RUN/."),
    ledger: str = LEDGER,
) -> None:
    """Write the run's curves as TensorBoard event files (`tensorboard --logdir OUT`), from the ledger:
    historical runs export too, and exporting again gives the same points."""
    from analysis.export import export_tensorboard

    con = connect_ledger(ledger, run_id)
    try:
        n = export_tensorboard(con, run_id, out)
    finally:
        con.close()
    console.print(f"wrote {n} points to {out / run_id} (`tensorboard --logdir {out}`)")


@export_app.command("dataset")
def dataset(
    run_id: str = typer.Argument(..., help="The run."),
    out: Path = typer.Option(..., "--out", help="Directory for the Parquet files (created)."),
    skip_unreadable: bool = typer.Option(
        False,
        "--skip-unreadable",
        help="Leave out steps whose screenshot is missing or corrupt (default: stop and name the first).",
    ),
    ledger: str = LEDGER,
) -> None:
    """Write the run's steps as a self-contained dataset: Parquet, one row per step with its outcome,
    reward and advantage, and the screenshot as an image column (verified against its hash). Loads with
    pyarrow, or `datasets.load_dataset("parquet", data_dir=OUT)`."""
    import pyarrow.parquet as pq
    from rich.progress import Progress

    from analysis.export import UnreadableScreenshot, export_dataset
    from pipeline.settings import StackSettings
    from pipeline.store import ScreenshotStore

    if out.exists() and any(out.iterdir()):
        raise fail(f"{out} is not empty; name a new directory with --out")
    con = connect_ledger(ledger, run_id)
    store = ScreenshotStore.from_settings(StackSettings().with_ledger(ledger))
    try:
        steps = con.execute("SELECT count(*) FROM steps WHERE run_id = $r", {"r": run_id}).fetchall()[0][0]
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("steps", total=steps)
            files, skipped = export_dataset(
                con,
                store.get,
                run_id,
                out,
                skip_unreadable=skip_unreadable,
                on_file=lambda path: progress.advance(task, pq.read_metadata(path).num_rows),
            )
    except UnreadableScreenshot as exc:
        raise fail(str(exc)) from None
    finally:
        con.close()
    left_out = f" ({skipped} left out: screenshot missing or corrupt)" if skipped else ""
    console.print(f"wrote {steps - skipped} steps in {len(files)} file(s) to {out}{left_out}")


def register(app: typer.Typer) -> None:
    app.command("view")(view)
    app.add_typer(export_app, name="export")
