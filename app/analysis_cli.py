"""`awrl sql | drift | report | lineage | rebatch | replay`: the analysis verbs, added to the main CLI by
`register(app)`.

Every verb opens the ledger named by `StackSettings().ledger_uri` (or `--ledger`) through
`analysis.connect`, i.e. an in-memory DuckDB holding only views, locked down. `sql` additionally
refuses any statement that is not a query, by DuckDB's own parser rather than by keyword matching
(so `WITH ... INSERT` or a second statement after `;` cannot slip through). Values given with
`--param name=value` are bound as DuckDB named parameters (`$name`), never pasted into the SQL text.
Like `app.cli`, each verb imports its machinery inside its function, so that `--help` is instant.
Every verb that reads takes `--format table|json|csv|markdown` (`app.output`); a verb about one run
checks first that the ledger holds it (`analysis.runs.require_run`: exit 2 on a mistyped id).
"""

from __future__ import annotations

import re
from dataclasses import asdict
from pathlib import Path
from typing import Literal

import duckdb
import typer

from app.output import FORMAT, NO, Format, console, emit_json, emit_record, emit_rows, fail

Filter = Literal["dynamic", "none", "raft"]
"""`analysis.rebatch.Filter` (not imported: `--help` stays fast; tests/test_cli.py checks they agree)."""

LEDGER = typer.Option(None, "--ledger", help="Ledger root (directory or s3://bucket/prefix); default: AWRL_LEDGER_URI.")
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
        raise BadParameters(
            f"the query uses {names} but no value was given (--param {missing[0]}=...); "
            "positional parameters (? or $1) are not supported"
        )
    unused = sorted(given.keys() - wanted)
    if unused:
        raise BadParameters(f"--param {', '.join(unused)} not used by the query (write ${unused[0]} in it)")


def connect_ledger(ledger: str | None, run_id: str | None = None) -> duckdb.DuckDBPyConnection:
    """The read-only ledger views (`analysis.connect`); with `run_id`, exit 2 unless the run is there."""
    from analysis.runs import require_run
    from analysis.views import connect
    from pipeline.settings import StackSettings

    settings = StackSettings().with_ledger(ledger)
    try:
        con = connect(settings, read_only=True)
    except OSError as exc:  # pyarrow's S3 or local filesystem: unreachable, refused, no such bucket
        raise fail(
            f"cannot read the ledger at {settings.ledger_uri}: {' '.join(str(exc).split())[:300]} "
            "(is the stack up? `awrl stack status`)"
        ) from None
    if run_id is not None:
        try:
            require_run(con, run_id)
        except BaseException:
            con.close()
            raise
    return con


def run_query(
    con: duckdb.DuckDBPyConnection, query: str, limit: int | None = None, params: dict[str, str] | None = None
) -> tuple[list[str], list[tuple], bool]:
    """(columns, rows, truncated) of a read-only query; at most `limit` rows are fetched.

    `params` are bound to the query's `$name` parameters by DuckDB, so a value is only ever data."""
    statement = check_read_only(con, query)
    _check_params(set(statement.named_parameters), params or {})
    cur = con.execute(query, params) if params else con.execute(query)
    columns = [d[0] for d in cur.description]
    rows = cur.fetchmany(limit + 1) if limit else cur.fetchall()
    truncated = bool(limit) and len(rows) > limit
    return columns, rows[:limit] if truncated else rows, truncated


def sql(
    query: str = typer.Argument(..., help="One read-only query over the ledger views (see `DESCRIBE steps`)."),
    format: Format = FORMAT,  # noqa: A002 - the option's name
    limit: int = typer.Option(100, help="Rows to print at most (0: all)."),
    param: list[str] = typer.Option(
        [],
        "--param",
        "-p",
        metavar="NAME=VALUE",
        help="Bind $NAME in the query to VALUE, repeatable. Values are text: cast in SQL, e.g. $n::INT.",
    ),
    ledger: str = LEDGER,
) -> None:
    """Run one read-only SQL query over the ledger views, e.g.
    `awrl sql 'SELECT * FROM steps WHERE run_id = $run AND step < $n::INT' -p run=r1 -p n=5`."""
    try:
        params = parse_params(param)
    except BadParameters as exc:
        raise fail(str(exc)) from None
    con = connect_ledger(ledger)
    try:
        columns, rows, truncated = run_query(con, query, limit or None, params)
    except NotReadOnly as exc:
        raise fail(f"refused: {exc}") from None
    except (BadParameters, duckdb.Error) as exc:
        raise fail(" ".join(str(exc).split())) from None
    finally:
        con.close()
    emit_rows(columns, rows, format)
    if truncated and format is Format.table:
        console.print(f"[dim]first {limit} rows shown; --limit 0 for all[/]")


def drift(
    run_id: str = typer.Argument(..., help="The run to measure."),
    format: Format = FORMAT,  # noqa: A002 - the option's name
    tokens: bool = typer.Option(
        True, "--tokens/--no-tokens", help="Token metrics (tokens per step, off-policy gap); they read every token."
    ),
    ledger: str = LEDGER,
) -> None:
    """Memory-schema drift metrics of one run (AsyncWebRL, arXiv 2606.05597, "Memory-schema drift")."""
    from analysis.drift import DriftConfig, drift_metrics

    con = connect_ledger(ledger, run_id)
    try:
        report = drift_metrics(con, run_id, DriftConfig(token_metrics=tokens)).to_dict()
    finally:
        con.close()
    emit_record(report, format, title=f"drift of run {run_id}")


def report(
    run_id: str = typer.Argument(..., help="The run to report on."),
    out: Path = typer.Option(Path("reports"), "--out", help="Directory for report.md and the plots."),
    ledger: str = LEDGER,
) -> None:
    """Markdown report with plots: drift metrics, keys per step, lengths by outcome, success over time."""
    from analysis.report import write_report

    con = connect_ledger(ledger, run_id)
    try:
        path = write_report(con, run_id, out)
    finally:
        con.close()
    console.print(f"wrote {path}")


def lineage(
    run_id: str = typer.Argument(..., help="The training run."),
    version: int = typer.Argument(..., help="A policy version the run published."),
    format: Format = FORMAT,  # noqa: A002 - the option's name
    ledger: str = LEDGER,
) -> None:
    """Which updates, trajectories, tasks and behaviour versions produced a checkpoint."""
    from analysis.lineage import lineage as find

    con = connect_ledger(ledger, run_id)
    try:
        found = find(con, run_id, version)
    except KeyError as exc:
        raise fail(
            f"{exc.args[0]} (`awrl sql \"SELECT version FROM policy_versions WHERE run_id = '{run_id}'\"`)"
        ) from None
    finally:
        con.close()
    if format is Format.json:
        emit_json(asdict(found))
        return
    columns = ["update_step", "version_before", "version_after", "trajectories", "loss", "grad_norm", "event_id"]
    rows = [
        [
            u["update_step"],
            u["version_before"],
            u["version_after"],
            u["trajectories"],
            u["loss"],
            u["grad_norm"],
            u["event_id"],
        ]
        for u in found.updates
    ]
    if format is Format.table:
        console.print(
            f"version {version} of {run_id}: versions {found.versions}, {len(found.updates)} updates, "
            f"{len(found.trajectories)} trajectories of {len(found.tasks)} tasks, outcomes {found.outcomes}, "
            f"steps by behaviour version {found.behaviour_versions}"
        )
    emit_rows(columns, rows, format)


def rebatch(
    run_id: str = typer.Argument(..., help="The training run."),
    eta: int = typer.Option(2, help="Counterfactual staleness bound."),
    rule: Filter = typer.Option("dynamic", "--filter", help="dynamic (drop all-equal rewards), none, or raft."),
    judge_name: str = typer.Option(
        None, "--judge", help="Rewards from this judge's verdicts (`verdicts`, e.g. `rejudged`); default: as recorded."
    ),
    png: Path = typer.Option(None, help="Also draw the staleness and advantage histograms here."),
    format: Format = FORMAT,  # noqa: A002 - the option's name
    ledger: str = LEDGER,
) -> None:
    """Counterfactual re-batching: which completed groups (trained or dropped) another rule would admit."""
    from analysis.rebatch import Admission
    from analysis.rebatch import rebatch as judge

    con = connect_ledger(ledger, run_id)
    try:
        found = judge(con, run_id, Admission(eta=eta, filter=rule, judge=judge_name))
    finally:
        con.close()
    if png:
        from analysis.curves import rebatch_png

        rebatch_png(found, png)
    if format is Format.json:
        emit_json(asdict(found))
        return
    if format is Format.table:
        console.print(
            f"{run_id} under eta={eta}, filter={rule}: {len(found.admitted)} of {found.groups} completed "
            f"groups admitted; dropped {found.dropped}; the run itself: {found.recorded}"
        )
        console.print(f"staleness (version lag -> groups): {found.staleness}")
    emit_rows(["version", "groups_admitted"], list(found.per_version.items()), format)


def replay(
    run_id: str = typer.Argument(..., help="The training run to replay."),
    variant: str = typer.Option(
        None, help="A named variant: per_trajectory, 1/k (constant), token, raft, tight-clip, no-dual-clip."
    ),
    set_: list[str] = typer.Option(
        [], "--set", help="Config override KEY=VALUE (dotted keys, JSON values), repeatable."
    ),
    updates: str = typer.Option(None, help="Update steps A..B (inclusive), or one step A; default all."),
    out: Path = typer.Option(Path("reports/replay"), help="Directory for replay.md and replay.png."),
    format: Format = FORMAT,  # noqa: A002 - the option's name
    ledger: str = LEDGER,
) -> None:
    """Re-run recorded updates offline from the ledger (bit-exact), optionally through a loss variant.
    Exit 1 when a replay of the recorded config is not bit-exact."""
    from rich.progress import Progress

    from analysis.replay import parse_overrides, update_range, write_report
    from analysis.replay import replay as run
    from pipeline.settings import StackSettings

    try:
        overrides = parse_overrides(variant, set_)  # fail fast, before any model is loaded
        selection = update_range(updates) if updates else None
    except (KeyError, ValueError) as exc:
        raise fail(str(exc)) from None
    connect_ledger(ledger, run_id).close()
    with Progress(
        console=console, transient=True, disable=format is not Format.table or not console.is_terminal
    ) as progress:
        task = progress.add_task("replaying", total=None)
        results = run(
            StackSettings().with_ledger(ledger),
            run_id,
            overrides or None,
            selection,
            on_batch=lambda i, n, _: progress.update(task, completed=i, total=n),
        )
    if not results:
        raise fail(f"run {run_id!r} has no recorded updates" + (f" in {updates}" if updates else ""))
    path = write_report(results, out, f"replay of {run_id}" + (f", variant {overrides}" if overrides else ""))
    if format is Format.json:
        emit_json(
            [
                {
                    "version_before": b.version_before,
                    "exact": b.exact,
                    "kl": b.kl,
                    "same": [vars(r) for r in b.same],
                    "variant": [vars(r) for r in b.variant] if b.variant else None,
                    "recorded": [
                        {
                            "update_step": u.update_step,
                            "loss": u.loss,
                            "grad_norm": u.grad_norm,
                            "weights_sha256": u.weights_sha256,
                        }
                        for u in b.recorded
                    ],
                }
                for b in results
            ]
        )
    elif format is Format.markdown:
        print(path.read_text(), end="")
    else:
        rows = [
            [
                s.update_step,
                "yes" if b.exact else "NO",
                u.loss,
                s.loss,
                v and v.loss,
                u.grad_norm,
                s.grad_norm,
                v and v.grad_norm,
                b.kl,
            ]
            for b in results
            for s, u, v in zip(b.same, b.recorded, b.variant or [None] * len(b.same))
        ]
        emit_rows(
            [
                "update",
                "exact",
                "loss_recorded",
                "loss_replayed",
                "loss_variant",
                "grad_norm_recorded",
                "grad_norm_replayed",
                "grad_norm_variant",
                "kl_recorded_variant",
            ],
            rows,
            format,
        )
        if format is Format.table:
            console.print(f"report: {path} (and replay.png beside it)")
    inexact = sum(not b.exact for b in results)
    if inexact:
        raise fail(f"{inexact} of {len(results)} batches did not replay bit-exactly (see {path})", NO)


def register(app: typer.Typer) -> None:
    """Add `sql`, `drift`, `report`, `lineage`, `rebatch` and `replay` to `app` (the main `awrl` CLI)."""
    app.command("sql")(sql)
    app.command("drift")(drift)
    app.command("report")(report)
    app.command("lineage")(lineage)
    app.command("rebatch")(rebatch)
    app.command("replay")(replay)
