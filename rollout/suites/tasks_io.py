"""Task files: one `Task` as JSON per line, validated on load.

Tasks are data, not code (the project design), so a bad file must fail loudly and point at the culprit: the
error names the file, the 1-based line number and the field, e.g.
`shop.jsonl:3: field 'difficulty': Input should be 'easy', 'medium' or 'hard'`.
Blank lines and lines starting with `#` are skipped (room for a header comment).
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import ValidationError

from schemas.observation import Task


class TaskFileError(ValueError):
    """A bad line in a task file; the message names the file, the line and the field."""


def load_tasks(path: str | Path) -> list[Task]:
    """All tasks of a JSONL file, validated; task ids must be unique within the file."""
    path = Path(path)
    tasks: list[Task] = []
    seen: dict[str, int] = {}
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        task = parse_task_line(line, f"{path}:{lineno}")
        if task.task_id in seen:
            raise TaskFileError(f"{path}:{lineno}: field 'task_id': duplicate of line {seen[task.task_id]}")
        seen[task.task_id] = lineno
        tasks.append(task)
    return tasks


def parse_task_line(line: str, where: str) -> Task:
    """One line as a `Task`; `where` ("file:line") prefixes any error."""
    try:
        data = json.loads(line)
    except json.JSONDecodeError as e:
        raise TaskFileError(f"{where}: not valid JSON: {e}") from e
    try:
        return Task.model_validate(data)
    except ValidationError as e:
        raise TaskFileError(f"{where}: {_describe(e)}") from e


def _describe(e: ValidationError) -> str:
    parts = []
    for err in e.errors():
        loc = ".".join(str(p) for p in err["loc"])
        parts.append(f"field '{loc}': {err['msg']}" if loc else err["msg"])
    return "; ".join(parts)
