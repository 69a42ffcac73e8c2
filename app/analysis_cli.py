"""`awrl sql | drift | report`: the analysis verbs, added to the main CLI by `register(app)`.

Every verb opens the ledger named by `StackSettings().ledger_uri` (or `--ledger`) through
`analysis.connect`, i.e. an in-memory DuckDB holding only views, locked down. `sql` additionally
refuses any statement that is not a query, by DuckDB's own parser rather than by keyword matching
(so `WITH ... INSERT` or a second statement after `;` cannot slip through). Values given with
`--param name=value` are bound as DuckDB named parameters (`$name`), never pasted into the SQL text.
Like `app.cli`, each verb imports its machinery inside its function, so that `--help` is instant.
"""

from __future__ import annotations

import csv
import io
import json as jsonlib
import re
from datetime import date, datetime, timedelta
from decimal import Decimal
from enum import Enum
from pathlib import Path
from typing import Literal

import duckdb
import typer
from rich.console import Console
from rich.table import Table

console = Console()
Filter = Literal["dynamic", "none", "raft"]
"""`analysis.rebatch.Filter` (not imported: `--help` stays fast; tests/test_cli.py checks they agree)."""

LEDGER = typer.Option(None, "--ledger", help="Ledger root (directory or s3://bucket/prefix); default: AWRL_LEDGER_URI.")
JSON = typer.Option(False, "--json", help="Print JSON instead of a table.")
_EXPLAIN = re.compile(r"^\s*EXPLAIN\s+(ANALY[SZ]E\s+)?(\([^)]*\)\s*)?", re.IGNORECASE)
_PARAM_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class NotReadOnly(ValueError):
    """The SQL text holds something other than exactly one query."""


class BadParameters(ValueError):
    """A `--param` is malformed, or the query's `$name` parameters and the values given differ."""


def check_read_only(con: duckdb.DuckDBPyConnection, query: str) -> duckdb.Statement:
    """Accept exactly one SELECT-type statement (SELECT, WITH ... SELECT, FROM, VALUES, DESCRIBE, SHOW,
    SUMMARIZE) or an EXPLAIN of one; refuse everything else, PRAGMA and CALL included.
    Returns the parsed statement."""
    try:
        statements = con.extract_statements(query)
    except duckdb.Error as exc:
        raise NotReadOnly(f"does not parse: {exc}") from exc
    if len(statements) != 1:
        raise NotReadOnly(f"expected exactly one statement, got {len(statements)}")
    kind = statements[0].type
    if kind == duckdb.StatementType.EXPLAIN:  # EXPLAIN ANALYZE runs its statement: check that one
        check_read_only(con, _EXPLAIN.sub("", statements[0].query, count=1))
    elif kind != duckdb.StatementType.SELECT:
        raise NotReadOnly(f"only queries are allowed, not {kind.name}")
    return statements[0]


def parse_params(items: list[str]) -> dict[str, str]:
    """`--param name=value` items as a dict; the value is everything after the first `=` (may be empty)."""
    params: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not _PARAM_NAME.fullmatch(name):
            raise BadParameters(f"--param takes name=value with a name like run_id, not {item!r}")
        if name in params:
            raise BadParameters(f"--param {name} given twice")
        params[name] = value
    return params


def _check_params(wanted: set[str], given: dict[str, str]) -> None:
    # DuckDB would refuse these too, but its messages speak of prepared statements, not of --param.
    missing = sorted(wanted - given.keys())
    if missing:
        names = ", ".join(f"${n}" for n in missing)
        raise BadParameters(f"the query uses {names} but no value was given (--param {missing[0]}=...); "
                            "positional parameters (? or $1) are not supported")
    unused = sorted(given.keys() - wanted)
    if unused:
        raise BadParameters(f"--param {', '.join(unused)} not used by the query (write ${unused[0]} in it)")


def _settings(ledger: str | None):
    from pipeline.settings import StackSettings

    settings = StackSettings()
    return settings.model_copy(update={"ledger_uri": ledger}) if ledger else settings


def _connect(ledger: str | None) -> duckdb.DuckDBPyConnection:
    from analysis.ledger import connect

    return connect(_settings(ledger), read_only=True)


def _plain(value):
    """JSON for what DuckDB returns: timestamps, intervals, decimals, maps (dicts), nested lists."""
    if isinstance(value, datetime | date):
        return value.isoformat()
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, Decimal):
        return float(value)
    if isinstance(value, bytes):
        return value.hex()
    return str(value)


def run_query(con: duckdb.DuckDBPyConnection, query: str, limit: int | None = None,
              params: dict[str, str] | None = None) -> tuple[list[str], list[tuple], bool]:
    """(columns, rows, truncated) of a read-only query; at most `limit` rows are fetched.

    `params` are bound to the query's `$name` parameters by DuckDB, so a value is only ever data."""
    statement = check_read_only(con, query)
    _check_params(set(statement.named_parameters), params or {})
    cur = con.execute(query, params) if params else con.execute(query)
    columns = [d[0] for d in cur.description]
    rows = cur.fetchmany(limit + 1) if limit else cur.fetchall()
    truncated = bool(limit) and len(rows) > limit
    return columns, rows[:limit] if truncated else rows, truncated


class Format(str, Enum):
    table = "table"
    csv = "csv"
    json = "json"
    markdown = "markdown"


def sql(
    query: str = typer.Argument(..., help="One read-only query over the ledger views (see `DESCRIBE steps`)."),
    format: Format = typer.Option(Format.table, "--format", "-f",  # noqa: A002 - the option's name
                                  help="table (one record per block when wider than the terminal), csv, json, markdown."),
    json: bool = typer.Option(False, "--json", help="Same as --format json."),
    limit: int = typer.Option(100, help="Rows to print at most (0: all)."),
    param: list[str] = typer.Option(
        [], "--param", "-p", metavar="NAME=VALUE",
        help="Bind $NAME in the query to VALUE, repeatable. Values are text: cast in SQL, e.g. $n::INT."),
    ledger: str = LEDGER,
) -> None:
    """Run one read-only SQL query over the ledger views, e.g.
    `awrl sql 'SELECT * FROM steps WHERE run_id = $run AND step < $n::INT' -p run=r1 -p n=5`."""
    try:
        params = parse_params(param)
    except BadParameters as exc:
        console.print(f"[bold red]error:[/] {exc}")
        raise typer.Exit(2) from None
    con = _connect(ledger)
    try:
        columns, rows, truncated = run_query(con, query, limit or None, params)
    except NotReadOnly as exc:
        console.print(f"[bold red]refused:[/] {exc}")
        raise typer.Exit(2) from None
    except BadParameters as exc:
        console.print(f"[bold red]error:[/] {exc}")
        raise typer.Exit(2) from None
    except duckdb.Error as exc:
        console.print(f"[bold red]error:[/] {exc}")
        raise typer.Exit(1) from None
    finally:
        con.close()
    _print_rows(columns, rows, Format.json if json else format)
    if truncated and not json and format is not Format.json:
        console.print(f"[dim]first {limit} rows shown; --limit 0 for all[/]", highlight=False)


def _print_rows(columns: list[str], rows: list[tuple], fmt: Format) -> None:
    if fmt is Format.json:
        typer.echo(jsonlib.dumps([dict(zip(columns, r)) for r in rows], default=_plain))
        return
    cells = [["NULL" if v is None else str(v) for v in row] for row in rows]
    if fmt is Format.csv:
        out = io.StringIO()
        csv.writer(out, lineterminator="\n").writerows([columns, *cells])
        typer.echo(out.getvalue(), nl=False)
    elif fmt is Format.markdown:
        def line(values):
            return "| " + " | ".join(v.replace("|", "\\|").replace("\n", " ") for v in values) + " |"
        typer.echo("\n".join([line(columns), "|" + "---|" * len(columns), *map(line, cells)]))
    elif _natural_width(columns, cells) <= console.width:
        table = Table(*columns)
        for row in cells:
            table.add_row(*row)
        console.print(table)
    else:  # psql's expanded display: one block per record, nothing squeezed to an ellipsis
        key = max(map(len, columns))
        for i, row in enumerate(cells, 1):
            console.print(f"[dim]-[ record {i} ]" + "-" * max(0, key - 10) + "[/]", highlight=False)
            for name, value in zip(columns, row):
                console.print(f"{name.ljust(key)} | {value}", highlight=False, soft_wrap=True)


def _natural_width(columns: list[str], cells: list[list[str]]) -> int:
    """Width of a boxed table showing every value whole."""
    widths = [max([len(c), *(len(r[i]) for r in cells)]) for i, c in enumerate(columns)]
    return sum(widths) + 3 * len(widths) + 1


def drift(
    run_id: str = typer.Argument(..., help="The run to measure."),
    json: bool = JSON,
    tokens: bool = typer.Option(True, "--tokens/--no-tokens",
                                help="Token metrics (tokens per step, off-policy gap); they read every token."),
    ledger: str = LEDGER,
) -> None:
    """Memory-schema drift metrics of one run (AsyncWebRL, arXiv 2606.05597, "Memory-schema drift")."""
    from analysis.drift import DriftConfig, drift_metrics

    con = _connect(ledger)
    try:
        report = drift_metrics(con, run_id, DriftConfig(token_metrics=tokens)).to_dict()
    finally:
        con.close()
    if json:
        typer.echo(jsonlib.dumps(report, default=_plain))
        return
    table = Table("metric", "value", title=f"drift of run {run_id}")
    for key, value in report.items():
        if not isinstance(value, list):
            table.add_row(key, "-" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value))
    console.print(table)


def report(
    run_id: str = typer.Argument(..., help="The run to report on."),
    out: Path = typer.Option(Path("reports"), "--out", help="Directory for report.md and the plots."),
    ledger: str = LEDGER,
) -> None:
    """Markdown report with plots: drift metrics, keys per step, lengths by outcome, success over time."""
    from analysis.report import write_report

    con = _connect(ledger)
    try:
        path = write_report(con, run_id, out)
    finally:
        con.close()
    console.print(f"wrote {path}")


def lineage(
    run_id: str = typer.Argument(..., help="The training run."),
    version: int = typer.Argument(..., help="A policy version the run published."),
    json: bool = JSON,
    ledger: str = LEDGER,
) -> None:
    """Which updates, trajectories, tasks and behaviour versions produced a checkpoint."""
    from dataclasses import asdict

    from analysis.lineage import lineage as find

    con = _connect(ledger)
    try:
        found = find(con, run_id, version)
    except KeyError as exc:
        console.print(f"[bold red]error:[/] {exc.args[0]}")
        raise typer.Exit(1) from None
    finally:
        con.close()
    if json:
        typer.echo(jsonlib.dumps(asdict(found), default=_plain))
        return
    console.print(f"version {version} of {run_id}: versions {found.versions}, {len(found.updates)} updates, "
                  f"{len(found.trajectories)} trajectories of {len(found.tasks)} tasks, outcomes {found.outcomes}, "
                  f"steps by behaviour version {found.behaviour_versions}")
    table = Table("update", "versions", "trajectories", "loss", "grad norm", "event id")
    for u in found.updates:
        table.add_row(str(u["update_step"]), f"{u['version_before']} -> {u['version_after']}", str(u["trajectories"]),
                      f"{u['loss']:.4g}", f"{u['grad_norm']:.4g}", u["event_id"])
    console.print(table)


def rebatch(
    run_id: str = typer.Argument(..., help="The training run."),
    eta: int = typer.Option(2, help="Counterfactual staleness bound."),
    rule: Filter = typer.Option("dynamic", "--filter", help="dynamic (drop all-equal rewards), none, or raft."),
    png: Path = typer.Option(None, help="Also draw the staleness and advantage histograms here."),
    json: bool = JSON,
    ledger: str = LEDGER,
) -> None:
    """Counterfactual re-batching: which completed groups (trained or dropped) another rule would admit."""
    from dataclasses import asdict

    from analysis.rebatch import Admission
    from analysis.rebatch import rebatch as judge

    if rule not in ("dynamic", "none", "raft"):
        console.print(f"[bold red]error:[/] --filter must be dynamic, none or raft, not {rule!r}")
        raise typer.Exit(2)
    con = _connect(ledger)
    try:
        found = judge(con, run_id, Admission(eta=eta, filter=rule))
    finally:
        con.close()
    if png:
        from analysis.curves import rebatch_png

        rebatch_png(found, png)
    if json:
        typer.echo(jsonlib.dumps(asdict(found), default=_plain))
        return
    console.print(f"{run_id} under eta={eta}, filter={rule}: {len(found.admitted)} of {found.groups} completed "
                  f"groups admitted; dropped {found.dropped}; the run itself: {found.recorded}")
    table = Table("version", "groups admitted")
    for version, n in found.per_version.items():
        table.add_row(str(version), str(n))
    console.print(table)
    console.print(f"staleness (version lag -> groups): {found.staleness}")


def replay(
    run_id: str = typer.Argument(..., help="The training run to replay."),
    variant: str = typer.Option(None, help="A named variant: per_trajectory, 1/k (constant), token, raft, "
                                           "tight-clip, no-dual-clip."),
    set_: list[str] = typer.Option([], "--set", help="Config override KEY=VALUE (dotted keys, JSON values), repeatable."),
    updates: str = typer.Option(None, help="Update steps A..B (inclusive); default all."),
    out: Path = typer.Option(Path("reports/replay"), help="Directory for replay.md and replay.png."),
    json: bool = JSON,
    ledger: str = LEDGER,
) -> None:
    """Re-run recorded updates offline from the ledger (bit-exact), optionally through a loss variant."""
    from rich.progress import Progress

    from analysis.replay import VARIANTS, write_report
    from analysis.replay import replay as run

    if variant and variant not in VARIANTS:
        console.print(f"[bold red]error:[/] unknown variant {variant!r}; known: {', '.join(VARIANTS)}")
        raise typer.Exit(2)
    overrides: dict[str, object] = dict(VARIANTS[variant]) if variant else {}
    for item in set_:
        key, _, value = item.partition("=")
        try:
            overrides[key] = jsonlib.loads(value)
        except jsonlib.JSONDecodeError:
            overrides[key] = value
    selection = None
    if updates:
        a, _, b = updates.partition("..")
        selection = range(int(a), int(b or a) + 1)
    try:
        from analysis.replay import with_overrides
        from trainer.config import TrainConfig

        with_overrides(TrainConfig(run_id="-"), overrides)  # fail fast, before any model is loaded
    except (KeyError, ValueError) as exc:
        console.print(f"[bold red]error:[/] {exc}")
        raise typer.Exit(2) from None
    with Progress(console=console, transient=True, disable=json) as progress:  # --json: stdout is the JSON
        task = progress.add_task("replaying", total=None)
        results = run(_settings(ledger), run_id, overrides or None, selection,
                      on_batch=lambda i, n, _: progress.update(task, completed=i, total=n))
    if not results:
        console.print(f"[bold red]error:[/] run {run_id!r} has no recorded updates in the ledger")
        raise typer.Exit(1)
    path = write_report(results, out, f"replay of {run_id}" + (f", variant {overrides}" if overrides else ""))
    if json:
        typer.echo(jsonlib.dumps([{"version_before": b.version_before, "exact": b.exact, "kl": b.kl,
                                   "same": [vars(r) for r in b.same],
                                   "variant": [vars(r) for r in b.variant] if b.variant else None,
                                   "recorded": [{"update_step": u.update_step, "loss": u.loss,
                                                 "grad_norm": u.grad_norm, "weights_sha256": u.weights_sha256}
                                                for u in b.recorded]} for b in results], default=_plain))
        return
    console.print(path.read_text(), markup=False, highlight=False)


def register(app: typer.Typer) -> None:
    """Add `sql`, `drift`, `report`, `lineage`, `rebatch` and `replay` to `app` (the main `awrl` CLI)."""
    app.command("sql")(sql)
    app.command("drift")(drift)
    app.command("report")(report)
    app.command("lineage")(lineage)
    app.command("rebatch")(rebatch)
    app.command("replay")(replay)
