"""Where a response's decision is, token by token.

A response is `{"thought": ..., "memory": {...}, "action": {"kind": "click", "mark": 2}}`: of its ~37
tokens only the action's values decide what happens on the page (in the boxes task, the one digit
after `"mark": `). The loss options of `trainer.losses.tokens` put the policy gradient on those tokens
(and, in a response that does not parse, on the token where it broke), and can keep the KL penalty on
the rest (the scaffold), so RL can move the decision without wearing the format down.
"""

from __future__ import annotations

import json
import re

_ACTION_KEY = re.compile(r'"action"\s*:\s*\{')
_FIELD = re.compile(r'"([^"\\]*)"\s*:\s*("(?:[^"\\]|\\.)*"|-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?|true|false|null)')
_DECODER = json.JSONDecoder()


def token_ends(tokenizer, token_ids: list[int]) -> list[int]:
    """The character offset in the decoded response where each token ends (non-decreasing)."""
    ends, last = [], 0
    for i in range(len(token_ids)):
        # a byte-level token can end inside a multi-byte character: the prefix's length can dip, never the end
        last = max(last, len(tokenizer.decode(token_ids[: i + 1], skip_special_tokens=False)))
        ends.append(last)
    return ends


def decision_spans(text: str, kind: bool = True) -> list[tuple[int, int]]:
    """Character spans of the response's decision: the values of the action object's fields (`kind`
    included: clicking instead of typing is a decision too; with `kind=False` the arguments only, the
    kind where the action has none); where the response does not parse, the
    character at which it went wrong (JSON's error position, or the `}` that closed the object without
    an action), since that token, not the well-formed prefix shared with every good response, is what
    a low reward should push down."""
    start = text.find("{")
    if start == -1:
        return [(0, min(1, len(text)))]
    try:
        obj, end = _DECODER.raw_decode(text, start)
    except json.JSONDecodeError as exc:
        return [(exc.pos, exc.pos + 1)]
    except RecursionError:  # nested past the interpreter's limit: the parser fails it at the start
        return [(start, start + 1)]
    match = _ACTION_KEY.search(text, start, end)
    if not isinstance(obj, dict) or not isinstance(obj.get("action"), dict) or match is None:
        return [(end - 1, end)]
    _, action_end = _DECODER.raw_decode(text, match.end() - 1)
    fields = list(_FIELD.finditer(text, match.end() - 1, action_end))
    arguments = [m for m in fields if m.group(1) != "kind"]
    return [m.span(2) for m in (fields if kind or not arguments else arguments)]


def decision_token_mask(tokenizer, token_ids: list[int], kind: bool = True) -> list[bool]:
    """True for each response token that overlaps the decision (`decision_spans`)."""
    ends = token_ends(tokenizer, token_ids)
    spans = decision_spans(tokenizer.decode(token_ids, skip_special_tokens=False), kind)
    starts = [0, *ends[:-1]]
    mask = [any(s < b and a < e for a, b in spans) for s, e in zip(starts, ends)]
    return mask if any(mask) else [True] * len(token_ids)  # an error past the last token: all of it
