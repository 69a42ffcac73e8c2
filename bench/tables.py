"""How a benchmark shows its result: a table for people, the same rows as markdown for RESULTS.md, and
the raw figures as JSON in bench/out/."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from pipeline.markdown import markdown_table

console = Console()
OUT = Path(__file__).parent / "out"


def show(title: str, head: list[str], rows: list[list[str]]) -> None:
    table = Table(title=title)
    for col in head:
        table.add_column(col)
    for row in rows:
        table.add_row(*row)
    console.print(table)
    console.print("\n".join(markdown_table(head, rows)), markup=False, highlight=False)


def write_json(name: str, data) -> Path:
    OUT.mkdir(exist_ok=True)
    path = OUT / f"{name}.json"
    path.write_text(json.dumps(data))
    return path
