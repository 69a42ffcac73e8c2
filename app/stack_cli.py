"""`awrl stack | ledger | health`: the infrastructure verbs, added to the main CLI by `register(app)`."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import typer
from rich.table import Table

from app.output import FORMAT, NO, Format, console, emit_json, emit_rows, fail
from pipeline.settings import StackSettings, stack_dir

stack_app = typer.Typer(
    help="The embedded local stack: Kafka-protocol broker + S3 store on 127.0.0.1.", no_args_is_help=True
)
ledger_app = typer.Typer(help="The Parquet ledger: every event of every run, exactly once.", no_args_is_help=True)
DATA_DIR = typer.Option(stack_dir(), "--data-dir", help="Where the stack keeps its data, logs and PID record.")
LEDGER_URI = typer.Option(None, help="Override AWRL_LEDGER_URI (s3://bucket/prefix or a directory).")


@stack_app.command("up")
def stack_up(
    data_dir: Path = DATA_DIR,
    durable: bool = typer.Option(
        True, "--durable/--ephemeral", help="Object store on a file that survives restarts, or in memory."
    ),
    kafka_port: int = typer.Option(None, help="Broker port (default: a free one)."),
    s3_port: int = typer.Option(None, help="S3 port (default: a free one)."),
    dotenv: Path = typer.Option(Path(".env"), help="Also write the connection settings here."),
    vllm: Path = typer.Option(
        None,
        help="Also serve this HF model directory with vLLM (the policy server of "
        "--policy vllm; its environment comes from `make vllm-env`).",
    ),
    vllm_cpus: str = typer.Option(None, help="Cores vLLM's threads bind to, e.g. 0 or 0-1 (default: vLLM's choice)."),
) -> None:
    """Start the stack (or report the running one) and write its settings to .env."""
    from pipeline.stack.local import LocalStack
    from pipeline.stack.vllm import VLLMServerConfig

    if vllm is not None and not (vllm / "config.json").is_file():
        raise fail(f"--vllm {vllm}: not an HF model directory (no config.json)")
    server = VLLMServerConfig(model_dir=vllm, cpus=vllm_cpus) if vllm is not None else None
    what = "broker, S3 store and vLLM (about 80 s)" if server else "Kafka-protocol broker and S3 store"
    with console.status(f"starting {what} ..."):
        stack = LocalStack.up(data_dir, durable=durable, kafka_port=kafka_port, s3_port=s3_port, vllm=server)
    if not stack.write_dotenv(dotenv):
        console.print(
            f"[yellow]{dotenv} exists and was not written by awrl; left it alone.[/] "
            f"Settings are in {data_dir / 'stack.env'}"
        )
    _print_status(stack, Format.table)


@stack_app.command("down")
def stack_down(data_dir: Path = DATA_DIR) -> None:
    """Stop exactly the processes `stack up` started."""
    from pipeline.stack.local import LocalStack

    stack = LocalStack.load(data_dir)
    if stack is None:
        console.print(f"no stack running from {data_dir}")
        return
    stack.down()
    console.print(f"stopped {data_dir}")


@stack_app.command("status")
def stack_status(data_dir: Path = DATA_DIR, format: Format = FORMAT) -> None:  # noqa: A002 - the option's name
    """Each service, its port, PID and health; exit 1 if none runs or any is unhealthy."""
    from pipeline.stack.local import LocalStack

    stack = LocalStack.load(data_dir)
    if stack is None:
        raise fail(f"no stack running from {data_dir} (`awrl stack up` starts one)", NO)
    if not _print_status(stack, format):
        raise typer.Exit(NO)


def _print_status(stack, fmt: Format) -> bool:
    health = stack.health()
    rows = [(s.name, s.port, s.pid, "up" if health.get(s.name, False) else "down") for s in stack.services]
    if fmt is not Format.table:
        emit_rows(["service", "port", "pid", "health"], rows, fmt)
        return all(health.values())
    table = Table("service", "port", "pid", "health", title=f"stack in {stack.data_dir}")
    for name, port, pid, state in rows:
        table.add_row(name, str(port or "-"), str(pid), "[green]up[/]" if state == "up" else "[red]down[/]")
    console.print(table)
    console.print(
        f"kafka {stack.kafka_bootstrap}   s3 http://{stack.s3.endpoint}   bucket {stack.bucket}"
        + (f"   vllm {stack.vllm_url} ({stack.vllm_model})" if stack.vllm_url else "")
    )
    return all(health.values())


@ledger_app.command("sync")
def ledger_sync(
    follow: bool = typer.Option(False, help="Keep writing as events arrive (until interrupted)."),
    ledger_uri: str = LEDGER_URI,
) -> None:
    """Consume every event topic into Parquet, exactly once (offsets committed after the files are
    durable; the ledger's journal names what an uncommitted flush wrote). For N writers, run this
    N times: they share the partitions as one consumer group, and take over a dead one's."""
    from pipeline.ledger import LedgerWriter

    settings = StackSettings().with_ledger(ledger_uri)
    writer = LedgerWriter(settings)
    stop = threading.Event()  # SIGTERM (compose's stop) ends it cleanly: its flush settled, its receipts out
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with console.status(f"writing {settings.ledger_uri} ...") as status:
        stats = writer.sync(
            follow=follow,
            stop=stop,
            on_flush=lambda s: status.update(
                f"{s.written:,} events in {s.files:,} files, {s.duplicates:,} duplicates skipped, "
                f"max lag {s.max_lag_s:.2f}s"
            ),
        )
    console.print(
        f"{stats.written:,} events written in {stats.files:,} files ({stats.bytes / 1e6:.1f} MB), "
        f"{stats.duplicates:,} duplicates skipped, max lag {stats.max_lag_s:.2f}s"
    )


@ledger_app.command("compact")
def ledger_compact(
    run_id: list[str] = typer.Option(..., "--run-id", help="Run(s) whose small files to merge (repeatable)."),
    ledger_uri: str = LEDGER_URI,
) -> None:
    """Merge runs' small event files into large sorted ones (what the Dagster `compaction` asset does);
    safe while writers, queries and other passes run."""
    from pipeline.ledger import compact_ledger

    settings = StackSettings().with_ledger(ledger_uri)
    for run in run_id:
        with console.status(f"compacting {run} ..."):
            results = compact_ledger(settings, run)
        if not results:
            raise fail(f"no files of run {run!r} under {settings.ledger_uri} (`awrl runs` lists the runs)")
        for event_type, r in sorted(results.items()):
            console.print(
                f"{run} {event_type}: {r.files_before} -> {r.files_after} files ({r.rows:,} rows merged, "
                f"{r.deleted} superseded files deleted)"
                + (" - another pass merged these files first; this one gave way" if r.yielded else "")
            )


@ledger_app.command("verify")
def ledger_verify(
    run_id: str = typer.Argument(None, help="The run to check (default: every run)."),
    format: Format = FORMAT,  # noqa: A002 - the option's name
    ledger_uri: str = LEDGER_URI,
) -> None:
    """Check what the ledger promises: no event stored twice, no trajectory with a step missing, no gap
    in the published versions, and (with AWRL_OUTBOX_DIR) no event left unconfirmed in an outbox. One
    line per check with its count; exit 1 when any found something (`analysis.verify`)."""
    from analysis.verify import judge_errors, verify
    from app.analysis_cli import connect_ledger

    settings = StackSettings().with_ledger(ledger_uri)
    with connect_ledger(settings.ledger_uri, run_id) as con:
        findings = verify(con, run_id, settings.outbox_dir)
        unjudged = judge_errors(con, run_id)
    if format is Format.json:
        emit_json([{"kind": f.kind, "count": f.count, "rows": f.rows} for f in findings])
    elif format is Format.table:
        for f in findings:
            console.print(f.line(), markup=False)
        why = " trajectories the reward's judge gave no verdict on (groups dropped; not a ledger fault)"
        console.print(f"judge errors: {unjudged}" + (why if unjudged else ""), markup=False)
    else:
        emit_rows(
            ["kind", "count", "first"], [[f.kind, f.count, f.rows[0] if f.rows else None] for f in findings], format
        )
    if found := [f"{f.count} {f.kind.replace('_', ' ')}" for f in findings if f.count]:
        raise fail(f"the ledger{f' of run {run_id}' if run_id else ''} is not sound: {', '.join(found)}", NO)


def health(
    max_age: float = typer.Option(120.0, help="Seconds after which a heartbeat is too old."),
    heartbeat: Path = typer.Option(
        None,
        envvar="AWRL_HEARTBEAT_FILE",
        show_envvar=True,
        help="The file the service touches while its main loop runs.",
    ),
) -> None:
    """A container healthcheck: exit 0 while the service's heartbeat is fresh, 1 otherwise."""
    from pipeline.health import age

    if heartbeat is None:
        raise fail("no heartbeat file: set AWRL_HEARTBEAT_FILE (docker-compose does) or pass --heartbeat")
    seconds = age(heartbeat)
    if seconds is None:
        raise fail(f"no heartbeat yet at {heartbeat}", NO)
    if seconds > max_age:
        raise fail(f"heartbeat {seconds:.0f} s old (limit {max_age:g} s): the service's main loop has stopped", NO)
    console.print(f"healthy: heartbeat {seconds:.0f} s old")


def register(app: typer.Typer) -> None:
    """Add `stack`, `ledger` and `health` to the main `awrl` CLI."""
    app.add_typer(stack_app, name="stack")
    app.add_typer(ledger_app, name="ledger")
    app.command("health")(health)
