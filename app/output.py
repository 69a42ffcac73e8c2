"""How every verb prints: one console, one `--format` option, one way to round for people.

- `table` (the default) is for people: numbers rounded, rich tables. When stdout is not a terminal
  the console is as wide as the text, so nothing is wrapped or cut mid-field (progress bars, which
  would be, are shown on terminals only).
- `json`, `csv` and `markdown` are for programs and documents: written with plain `print`, never
  wrapped, truncated, coloured or rounded.
- Errors go to stderr as one line (`fail`), with the exit codes of `app.cli`'s docstring.
"""

from __future__ import annotations

import csv
import io
import json
import math
import sys
from collections.abc import Iterable, Mapping
from datetime import date, datetime, timedelta
from decimal import Decimal
from enum import Enum
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from pipeline.markdown import markdown_table

# rich lays out for 80 columns when it cannot ask a terminal, which wraps a table or cuts a line
# mid-field in a log; these consoles print only tables and lines (no panels), so as wide as the text.
console = Console(soft_wrap=True, highlight=False, width=None if sys.stdout.isatty() else 1 << 16)
errors = Console(stderr=True, soft_wrap=True, highlight=False, width=None if sys.stderr.isatty() else 1 << 16)

USAGE = 2
"""Exit code of a usage error, an unknown run or a missing setting."""
NO = 1
"""Exit code of a result that says no (a replay that is not bit-exact, an unhealthy stack)."""


class Format(str, Enum):  # noqa: UP042 - a StrEnum would change str() and format() of its members
    table = "table"
    json = "json"
    csv = "csv"
    markdown = "markdown"


FORMAT = typer.Option(Format.table, "--format", "-f", help="table (for people), json, csv or markdown.")


def fail(message: str, code: int = USAGE) -> typer.Exit:
    """Print `error: message` on stderr and return the `typer.Exit` to raise."""
    errors.print(f"[bold red]error:[/] {escape(message)}")
    return typer.Exit(code)


def plain(value):
    """A JSON-able form of what configs and DuckDB return: times, intervals, decimals, paths, bytes."""
    if isinstance(value, datetime | date):
        return value.isoformat()
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, Decimal):
        return float(value)
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, Path | Enum):
        return str(value.value if isinstance(value, Enum) else value)
    if isinstance(value, set | frozenset | tuple):
        return list(value)
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json")
    return str(value)


def human(value) -> str:
    """A value rounded for people: 2,873 rather than 2872.737, 0.123 rather than 0.12345678."""
    if value is None:
        return "-"
    if isinstance(value, datetime):
        return value.isoformat(sep=" ", timespec="seconds")
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if math.isnan(value) or math.isinf(value):
        return str(value)
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 1:
        return f"{value:.2f}"
    return f"{value:.3g}"


def emit_json(data) -> None:
    print(json.dumps(data, default=plain))


def emit_rows(columns: list[str], rows: Iterable[Iterable], fmt: Format, title: str | None = None) -> None:
    """Rows of a result in `fmt`; a table too wide for the terminal becomes one block per record."""
    rows = [list(r) for r in rows]
    if fmt is Format.json:
        emit_json([dict(zip(columns, r)) for r in rows])
        return
    if fmt is Format.table:
        _table(
            columns,
            [[human(v) if v is None or isinstance(v, float | int | datetime) else str(v) for v in r] for r in rows],
            title,
        )
        return
    cells = [["" if v is None else _text(v) for v in r] for r in rows]
    if fmt is Format.csv:
        out = io.StringIO()
        csv.writer(out, lineterminator="\n").writerows([columns, *cells])
        print(out.getvalue(), end="")
    else:
        print("\n".join(markdown_table(columns, cells)))


def emit_record(record: Mapping[str, object], fmt: Format, title: str | None = None) -> None:
    """One result as `what | value` rows (json: the whole mapping, nested values included)."""
    if fmt is Format.json:
        emit_json(dict(record))
        return
    flat = [
        (k.replace("_", " ") if fmt is Format.table else k, v)
        for k, v in record.items()
        if not isinstance(v, list | dict)
    ]
    emit_rows(["what", "value"], flat, fmt, title)


def _text(value) -> str:
    """A cell for csv and markdown: exact (no rounding), nested values as JSON."""
    if isinstance(value, list | dict | tuple):
        return json.dumps(value, default=plain)
    if isinstance(value, float | int | str):
        return str(value)
    return str(plain(value))


def _table(columns: list[str], cells: list[list[str]], title: str | None) -> None:
    widths = [max([len(c), *(len(r[i]) for r in cells)]) for i, c in enumerate(columns)]
    if sum(widths) + 3 * len(widths) + 1 <= console.width:
        table = Table(*columns, title=title)
        for row in cells:
            table.add_row(*row)
        console.print(table)
        return
    # psql's expanded display: one block per record, nothing squeezed to an ellipsis
    key = max(map(len, columns))
    if title:
        console.print(title)
    for i, row in enumerate(cells, 1):
        console.print(f"[dim]-[ record {i} ]" + "-" * max(0, key - 10) + "[/]")
        for name, value in zip(columns, row):
            console.print(f"{name.ljust(key)} | {value}", markup=False)
