"""Model output -> (thought, memory, Action). Anything unusable becomes an `invalid` action, never a crash.

The response format is one JSON object `{"thought": str, "memory": {...}, "action": {...}}`. Small
models wrap it in prose or code fences, so the first balanced JSON object in the text is taken.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from urllib.parse import urlparse

from pydantic import ValidationError

from schemas import Action

MAX_TEXT = 2000
"""Longest `type`/`answer` text accepted; longer is an invalid action (a runaway generation)."""


@dataclass(frozen=True)
class Parsed:
    thought: str
    memory: dict[str, str]
    """The memory carried forward: the previous one updated with this response's keys."""
    action: Action


def parse_response(text: str, memory: dict[str, str], allowed_hosts: frozenset[str]) -> Parsed:
    obj = _first_json_object(text)
    if not isinstance(obj, dict):
        return Parsed("", memory, _invalid("no JSON object in the response"))
    thought = obj.get("thought")
    thought = thought if isinstance(thought, str) else ""
    new_memory = {**memory, **_as_memory(obj.get("memory"))}
    raw = obj.get("action")
    if not isinstance(raw, dict):
        return Parsed(thought, new_memory, _invalid("missing 'action' object"))
    try:
        action = Action.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(map(str, err["loc"])) or "action"
        return Parsed(thought, new_memory, _invalid(f"bad action ({where}: {err['msg']})"))
    return Parsed(thought, new_memory, _checked(action, allowed_hosts))


def _checked(action: Action, allowed_hosts: frozenset[str]) -> Action:
    if action.kind == "invalid":
        return _invalid("the model may not emit 'invalid' itself")
    if action.text is not None and len(action.text) > MAX_TEXT:
        return _invalid(f"text longer than {MAX_TEXT} characters")
    if action.kind == "goto":
        host = urlparse(action.url or "").hostname
        if host not in allowed_hosts:
            return _invalid(f"goto to a host that is not allowed: {host!r}")
    return action


def _invalid(reason: str) -> Action:
    return Action(kind="invalid", reason=reason)


def _as_memory(value) -> dict[str, str]:
    if not isinstance(value, dict):
        return {}
    return {str(k): v if isinstance(v, str) else json.dumps(v, ensure_ascii=False) for k, v in value.items()}


def _first_json_object(text: str):
    """The first `{...}` that parses, scanning brace depth outside strings."""
    start = text.find("{")
    while start != -1:
        depth, in_str, escape = 0, False, False
        for i in range(start, len(text)):
            c = text[i]
            if in_str:
                if escape:
                    escape = False
                elif c == "\\":
                    escape = True
                elif c == '"':
                    in_str = False
                continue
            if c == '"':
                in_str = True
            elif c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
                if depth == 0:
                    try:
                        return json.loads(text[start : i + 1])
                    except json.JSONDecodeError:
                        break
        start = text.find("{", start + 1)
    return None


def describe(action: Action) -> str:
    """Compact text form for the history shown to the model: `click(mark=7)`, `type('abc')`."""
    args = action.model_dump(exclude_none=True, exclude={"kind"})
    return f"{action.kind}(" + ", ".join(f"{k}={v!r}" for k, v in args.items()) + ")"
