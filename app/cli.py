"""`awrl`: one command, a verb per job.

Conventions, the same for every verb (psql's, gh's and kubectl's):
- exit 0 when it worked; 1 when the result says no (a replay that is not bit-exact, an unhealthy stack
  or service); 2 for a usage error, an unknown run or a missing setting;
- a user's mistake prints one line on stderr that says what to do, never a traceback
  (`app.errors.user_error` knows which exceptions are mistakes);
- every verb that reads or reports takes `--format table|json|csv|markdown` (`app.output`);
- settings are found in one order: environment, `./.env`, the local stack's `stack.env`.

Each verb imports its machinery (torch, Playwright, Dagster, the stack) inside its function, so that
`awrl --help` and a mistyped option answer at once instead of after seconds of loading.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
from importlib import metadata

import typer
import typer.core
from rich.markup import escape

from app import analysis_cli, judge_cli, run_cli, runs_cli, stack_cli, view_cli
from app.errors import ConfigError, user_error
from app.output import errors

app = typer.Typer(
    help="AsyncWebRL: event-sourced asynchronous multi-step RL for visual web agents.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _version(value: bool) -> None:
    if value:
        try:
            print(f"awrl {metadata.version('asyncwebrl')}")
        except metadata.PackageNotFoundError:
            print("awrl (not installed as a package)")
        raise typer.Exit()


@app.callback()
def root(
    version: bool = typer.Option(
        False, "--version", is_eager=True, callback=_version, help="Print the version and exit."
    ),
) -> None:
    """AsyncWebRL: event-sourced asynchronous multi-step RL for visual web agents."""


run_cli.register(app)
stack_cli.register(app)
runs_cli.register(app)
analysis_cli.register(app)
judge_cli.register(app)
view_cli.register(app)


def _log_level(level: str | None) -> None:
    if not level:
        return
    if not isinstance(logging.getLevelName(level.upper()), int):
        raise ConfigError(f"AWRL_LOG_LEVEL={level!r} is not a log level (DEBUG, INFO, WARNING, ERROR)")
    logging.basicConfig(
        level=level.upper(), stream=sys.stderr, format="%(asctime)s %(threadName)s %(name)s %(message)s"
    )


def main(argv: list[str] | None = None) -> None:
    """The `awrl` entry point: the CLI, with users' mistakes told in one line (exit 2) instead of a
    traceback; anything else is a bug and keeps its traceback. `AWRL_LOG_LEVEL` (e.g. INFO) turns on
    the libraries' logs on stderr: the Kafka client's group joins and rebalances, for one."""
    try:
        _log_level(os.environ.get("AWRL_LOG_LEVEL"))
        # The command itself, not `app(...)`: typer marks every escaping exception with an attribute,
        # and minio's S3Error is frozen, so a store error became "S3Error is frozen" (seen in the soak).
        code = typer.main.get_command(app)(args=argv, prog_name="awrl", standalone_mode=False)
    except typer.Abort:
        sys.exit(130)
    except typer.TyperException as exc:  # typer's click: a usage error, in one line rather than a box
        hint = f" (`{exc.ctx.command_path} --help`)" if getattr(exc, "ctx", None) else ""
        errors.print(f"[bold red]error:[/] {escape(exc.format_message() + hint)}")
        sys.exit(exc.exit_code)
    except Exception as exc:  # noqa: BLE001 - sorted into mistakes and bugs right here
        known = user_error(exc)
        if known is None:
            raise
        message, code = known
        errors.print(f"[bold red]error:[/] {escape(message)}")
    sys.exit(code or 0)


def check_args(argv: list[str]) -> str | None:
    """None when `awrl <argv>` parses (nothing runs), else the error message. For checking commands
    written elsewhere (docker-compose.yml) against the verbs' real options."""
    command = typer.main.get_command(app)
    args, parent, name = list(argv), None, "awrl"
    try:
        # a --help in the arguments prints (and exits 0): not here
        with contextlib.redirect_stdout(io.StringIO()):
            while isinstance(command, typer.core.TyperGroup):
                verb = next((i for i, a in enumerate(args) if a in command.commands), None)
                if verb is None:
                    if command.invoke_without_command:  # `awrl runs` lists on its own
                        command.make_context(name, args, parent=parent, resilient_parsing=False)
                        return None
                    return f"no verb of `{name}` in {args}" if args else None
                # the verb's name included: a group given no arguments would print its help
                parent = command.make_context(name, args[: verb + 1], parent=parent, resilient_parsing=False)
                name, command, args = f"{name} {args[verb]}", command.commands[args[verb]], args[verb + 1 :]
            command.make_context(name, args, parent=parent, resilient_parsing=False)  # tyro's verbs parse here too
    except (typer.Exit, SystemExit):
        return None
    except typer.TyperException as exc:
        return exc.format_message()
    except ConfigError as exc:  # tyro's usage errors too (`app.configs.parse`)
        return str(exc)
    return None


if __name__ == "__main__":
    main()
