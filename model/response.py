"""Where a response's decision is, token by token.

A response is `{"thought": ..., "memory": {...}, "action": {"kind": "click", "mark": 2}}`: of its ~37
tokens only the action's values decide what happens on the page (in the boxes task, the one digit
after `"mark": `). The loss options of `trainer.losses.tokens` put the policy gradient on those tokens
and keep the KL penalty on the rest (the scaffold), so RL can move the decision without wearing the
format down.
"""

from __future__ import annotations

import json
import re

_ACTION_KEY = re.compile(r'"action"\s*:\s*\{')
_FIELD = re.compile(r'"[^"\\]*"\s*:\s*("(?:[^"\\]|\\.)*"|-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?|true|false|null)')
_DECODER = json.JSONDecoder()


def token_ends(tokenizer, token_ids: list[int]) -> list[int]:
    """The character offset in the decoded response where each token ends (non-decreasing)."""
    ends, last = [], 0
    for i in range(len(token_ids)):
        # a byte-level token can end inside a multi-byte character: the prefix's length can dip, never the end
        last = max(last, len(tokenizer.decode(token_ids[: i + 1], skip_special_tokens=False)))
        ends.append(last)
    return ends


def action_value_spans(text: str) -> list[tuple[int, int]]:
    """Character spans of the values of the action object's fields (`kind` included: clicking instead
    of typing is a decision too); [] when the response has no action object that parses."""
    match = _ACTION_KEY.search(text)
    if match is None:
        return []
    start = match.end() - 1
    try:
        _, end = _DECODER.raw_decode(text, start)
    except ValueError:
        return []
    return [m.span(1) for m in _FIELD.finditer(text, start, end)]


def action_token_mask(tokenizer, token_ids: list[int]) -> list[bool] | None:
    """True for each response token that overlaps a value of the action object; None when the response
    has no parsable action (then no token is the decision: the caller treats every token alike)."""
    ends = token_ends(tokenizer, token_ids)
    spans = action_value_spans(tokenizer.decode(token_ids, skip_special_tokens=False))
    if not spans:
        return None
    starts = [0, *ends[:-1]]
    return [any(s < b and a < e for a, b in spans) for s, e in zip(starts, ends)]
