"""A markdown table, the one way it is built: for the CLI's `--format markdown`, reports and benchmarks.

"\n".join(markdown_table(["run", "steps"], [["a", "12"], ["b", "7"]]))
"""

from __future__ import annotations

from collections.abc import Iterable


def markdown_table(head: Iterable[str], rows: Iterable[Iterable[str]]) -> list[str]:
    """The table's lines: header, rule, one per row. A `|` in a cell is escaped and a newline becomes a
    space, so that every row keeps its columns."""
    head = list(head)
    return [_line(head), "|" + "---|" * len(head), *map(_line, rows)]


def _line(cells: Iterable[str]) -> str:
    return "| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in cells) + " |"
