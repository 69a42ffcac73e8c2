"""`awrl runs` and `awrl runs show RUN`: what a ledger holds, and how to launch any of it again."""

from __future__ import annotations

import json
from enum import Enum

import typer

from app.output import FORMAT, Format, console, emit_rows, fail

runs_app = typer.Typer(
    help="The runs in the ledger (`awrl runs`), and each one's recorded config (`awrl runs show`).",
    invoke_without_command=True,
)
LEDGER = typer.Option(None, "--ledger", help="Ledger root (directory or s3://bucket/prefix); default: AWRL_LEDGER_URI.")
COLUMNS = ("run_id", "started_at", "command", "suite", "versions", "episodes", "success")


@runs_app.callback()
def runs(
    ctx: typer.Context,
    format: Format = FORMAT,
    ledger: str = LEDGER,  # noqa: A002 - the option's name
    last: bool = typer.Option(
        False,
        "--last",
        help="Print only the id of the latest run started by `awrl run`, `demo` or `train` (for scripts: RUN=$(...)).",
    ),
) -> None:
    """List the runs in the ledger: id, start, the command that started it, suite, policy versions
    published, episodes and their success rate."""
    if ctx.invoked_subcommand is not None:
        return
    from analysis.browse import page_url
    from app.analysis_cli import connect_ledger
    from pipeline.settings import StackSettings

    con = connect_ledger(ledger)
    try:
        if last:
            row = con.execute(
                "SELECT run_id FROM runs WHERE command IS NOT NULL ORDER BY started_at DESC LIMIT 1"
            ).fetchone()
            if row is None:
                raise fail("no run started by `awrl run`, `demo` or `train` in the ledger (`make demo` makes one)")
            print(row[0])
            return
        rows = con.execute(f"SELECT {', '.join(COLUMNS)} FROM runs ORDER BY started_at").fetchall()
    finally:
        con.close()
    if not rows and format is Format.table:
        console.print("the ledger has no runs yet (`make demo` makes one; `awrl ledger sync` folds new events in)")
        return
    emit_rows(list(COLUMNS), rows, format)
    if format is Format.table:
        viewer = StackSettings().viewer_url
        console.print(
            f"see them: [bold]awrl view[/], then {page_url(viewer)} (one run: {page_url(viewer, rows[-1][0])})",
            soft_wrap=True,
        )


class ShowFormat(str, Enum):  # noqa: UP042 - as app.output.Format: a StrEnum changes str()
    yaml = "yaml"
    json = "json"


@runs_app.command("show")
def show(
    run_id: str = typer.Argument(..., help="The run."),
    format: ShowFormat = typer.Option(  # noqa: A002 - the option's name
        ShowFormat.yaml,
        "--format",
        "-f",
        help="yaml (what `--config` reads) or json.",
    ),
    ledger: str = LEDGER,
) -> None:
    """The run's resolved config, as `awrl <command> --config FILE` reads it: save it, edit it, launch
    it again. The run id is emptied, so the relaunch is a new run (the original is in the header)."""
    from analysis.runs import run_config
    from app.analysis_cli import connect_ledger
    from app.configs import to_yaml

    con = connect_ledger(ledger)
    try:
        found = run_config(con, run_id)
    finally:
        con.close()
    if found is None:
        raise fail(f"run {run_id!r} recorded no config (it predates RunStarted, or a plain `awrl rollout` made it)")
    command, config = found
    if command != "train":  # a relaunch is a new run; a trainer is bound to the run whose groups it trains
        config = _new_run(config)
    if format is ShowFormat.json:
        print(json.dumps(config))
        return
    print(
        to_yaml(
            config,
            f"Recorded config of run {run_id} (awrl {command}); launch it again with\n"
            f"  awrl {command} --config FILE   (flags given beside it override the file)",
        ),
        end="",
    )


def _new_run(config: dict) -> dict:
    """The config with every `run_id` (the run's, and those the run set in the configs it holds) empty."""
    return {k: "" if k == "run_id" else _new_run(v) if isinstance(v, dict) else v for k, v in config.items()}


def register(app: typer.Typer) -> None:
    app.add_typer(runs_app, name="runs")
