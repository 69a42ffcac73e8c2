"""Model output -> (thought, memory, Action). Anything unusable becomes an `invalid` action, never a crash.

The response format is one JSON object `{"thought": str, "memory": {...}, "action": {...}}`. Small
models wrap it in prose or code fences, so the first JSON object in the text is taken.

The output is untrusted: a policy can emit anything, and a `goto` is the one action that could leave
the task's sites. So a `goto` must be http(s) to an allowed host with nothing a browser reads
differently from `urllib` (backslashes, whitespace, user info); coordinates must be on screen; and no
text the event log cannot encode (lone surrogates) gets through.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from pydantic import ValidationError

from schemas import Action

MAX_TEXT = 2000
"""Longest `type`/`answer` text accepted; longer is an invalid action (a runaway generation)."""
MAX_RESPONSE = 32_000
"""Longest response parsed, in characters (~8k tokens); longer is a runaway generation, and the JSON
search must stay cheap whatever the model emits."""
MAX_COORD = 8192
"""Largest x or y accepted when the viewport is not given (wider than any screen we render)."""
MAX_SCROLL = 10_000
"""Largest |dx| or |dy| of a scroll, in pixels."""
_MAX_STARTS = 64
"""`{` positions tried as the start of the JSON object; real outputs have a handful of stray braces."""
_SCHEMES = frozenset({"http", "https"})
_NUMBERS = ("x", "y", "mark", "dx", "dy")
_STRINGS = ("text", "key", "url")
# C0 controls other than tab, newline and CR, DEL, and lone surrogates (json.loads makes them from
# "\ud800" escapes; they cannot be encoded as UTF-8, so an event carrying one could not be sent).
_BAD_CHARS = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f\ud800-\udfff]")
_SURROGATE = re.compile(r"[\ud800-\udfff]")
# Browsers treat `\` as `/` in http(s) URLs and strip whitespace where urllib does not: either could
# make the host a browser visits differ from the one checked here.
_URL_UNSAFE = re.compile(r"[\s\\\x00-\x1f\x7f]")
_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class Parsed:
    thought: str
    memory: dict[str, str]
    """The memory carried forward: the previous one updated with this response's keys."""
    action: Action


def parse_response(
    text: str, memory: dict[str, str], allowed_hosts: frozenset[str], viewport: tuple[int, int] | None = None
) -> Parsed:
    """Thought, memory and action of one response; `viewport` (width, height) bounds click coordinates."""
    if len(text) > MAX_RESPONSE:
        return Parsed("", memory, _invalid(f"response longer than {MAX_RESPONSE} characters"))
    obj = _first_json_object(text)
    if not isinstance(obj, dict):
        return Parsed("", memory, _invalid("no JSON object in the response"))
    thought = obj.get("thought")
    thought = _printable(thought) if isinstance(thought, str) else ""
    new_memory = {**memory, **_as_memory(obj.get("memory"))}
    raw = obj.get("action")
    if not isinstance(raw, dict):
        return Parsed(thought, new_memory, _invalid("missing 'action' object"))
    return Parsed(thought, new_memory, _action(raw, allowed_hosts, viewport))


def _action(raw: dict, allowed_hosts: frozenset[str], viewport: tuple[int, int] | None) -> Action:
    # pydantic's lax mode would read `true` as 1: a boolean coordinate is a wrong type, not a number.
    flag = next((f for f in _NUMBERS if isinstance(raw.get(f), bool)), None)
    if flag is not None:
        return _invalid(f"bad action ({flag}: a boolean is not a number)")
    if raw.get("kind") != "invalid":  # `reason` is the parser's account of an invalid action, not the model's
        raw = {k: v for k, v in raw.items() if k != "reason"}
    try:
        action = Action.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(map(str, err["loc"])) or "action"
        return _invalid(f"bad action ({where}: {err['msg']})")
    problem = _problem(action, allowed_hosts, viewport)
    return _invalid(problem) if problem else action


def _problem(action: Action, allowed_hosts: frozenset[str], viewport: tuple[int, int] | None) -> str | None:
    if action.kind == "invalid":
        return "the model may not emit 'invalid' itself"
    if action.text is not None and len(action.text) > MAX_TEXT:
        return f"text longer than {MAX_TEXT} characters"
    for name in _STRINGS:
        value = getattr(action, name)
        if value is not None and _BAD_CHARS.search(value):
            return f"{name} holds control characters or lone surrogates"
    return _range_problem(action, viewport) or (
        _goto_problem(action.url or "", allowed_hosts) if action.kind == "goto" else None
    )


def _range_problem(action: Action, viewport: tuple[int, int] | None) -> str | None:
    width, height = viewport or (MAX_COORD + 1, MAX_COORD + 1)
    for name, limit in (("x", width), ("y", height)):
        value = getattr(action, name)
        if value is not None and not 0 <= value < limit:
            return f"{name}={value} is off the {width}x{height} screen" if viewport else f"{name}={value} out of range"
    if action.mark is not None and action.mark < 0:
        return f"mark={action.mark} is negative"
    for name in ("dx", "dy"):
        value = getattr(action, name)
        if value is not None and abs(value) > MAX_SCROLL:
            return f"{name}={value} scrolls more than {MAX_SCROLL} pixels"
    return None


def _goto_problem(url: str, allowed_hosts: frozenset[str]) -> str | None:
    if _URL_UNSAFE.search(url):
        return "goto to a url with whitespace, control characters or a backslash is not allowed"
    try:
        parts = urlsplit(url)
        _ = parts.port  # raises on a port that is not a number in range
    except ValueError as exc:
        return f"goto to a malformed url is not allowed ({exc})"
    if parts.scheme not in _SCHEMES:
        return f"goto to a scheme that is not allowed: {parts.scheme!r}"
    if "@" in parts.netloc:
        return "goto to a url with user info is not allowed"
    if parts.hostname not in allowed_hosts:
        return f"goto to a host that is not allowed: {parts.hostname!r}"
    return None


def _invalid(reason: str) -> Action:
    return Action(kind="invalid", reason=reason)


def _printable(value: str) -> str:
    """`value` with lone surrogates replaced, so the event that carries it can be encoded."""
    return _SURROGATE.sub("\ufffd", value)


def _as_memory(value) -> dict[str, str]:
    if not isinstance(value, dict):
        return {}
    return {
        _printable(str(k)): _printable(v if isinstance(v, str) else json.dumps(v, ensure_ascii=False))
        for k, v in value.items()
    }


def _first_json_object(text: str):
    """The first JSON object that parses from a `{`, trying at most `_MAX_STARTS` of them.

    The C decoder stops at the first character that cannot continue JSON, so a stray `{` in prose
    costs almost nothing; nesting beyond the interpreter's recursion limit fails like bad JSON."""
    start = text.find("{")
    for _ in range(_MAX_STARTS):
        if start == -1:
            return None
        try:
            return _DECODER.raw_decode(text, start)[0]
        except (ValueError, RecursionError):
            start = text.find("{", start + 1)
    return None


def describe(action: Action) -> str:
    """Compact text form for the history shown to the model: `click(mark=7)`, `type('abc')`."""
    args = action.model_dump(exclude_none=True, exclude={"kind"})
    return f"{action.kind}(" + ", ".join(f"{k}={v!r}" for k, v in args.items()) + ")"
