"""Model output of every kind becomes an action or an `invalid` action, never an exception."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout.actions import describe, parse_response

HOSTS = frozenset({"127.0.0.1"})


def ok(action: dict, **extra) -> str:
    return json.dumps({"thought": "t", "memory": {"k": "v"}, "action": action, **extra})


@pytest.mark.parametrize("action", [
    {"kind": "click", "x": 10, "y": 20}, {"kind": "click", "mark": 3}, {"kind": "type", "text": "hi"},
    {"kind": "type", "text": "hi", "mark": 2}, {"kind": "press", "key": "Enter"},
    {"kind": "scroll", "dx": 0, "dy": 300}, {"kind": "goto", "url": "http://127.0.0.1:8000/cart"},
    {"kind": "answer", "text": "Paris"}, {"kind": "stop"},
])
def test_valid_actions_parse(action):
    parsed = parse_response("Sure!\n```json\n" + ok(action) + "\n```", {}, HOSTS)
    assert parsed.action.model_dump(exclude_none=True) == action
    assert parsed.thought == "t" and parsed.memory == {"k": "v"}


@pytest.mark.parametrize("text, reason", [
    ("", "no JSON object"),
    ("I will click the button", "no JSON object"),
    ('{"thought": "x"}', "missing 'action'"),
    (ok({"kind": "fly"}), "bad action"),
    (ok({"kind": "click", "x": 1}), "x and y, or mark"),
    (ok({"kind": "click", "x": "left", "y": 2}), "bad action"),
    (ok({"kind": "goto", "url": "https://example.com/"}), "not allowed"),
    (ok({"kind": "goto", "url": "file:///etc/passwd"}), "not allowed"),
    (ok({"kind": "type", "text": "x" * 5000}), "longer than"),
    (ok({"kind": "invalid", "reason": "me"}), "may not emit"),
    (ok({"kind": "stop", "extra": 1}), "bad action"),
    ('{"action": {"kind": "stop"', "no JSON object"),
])
def test_bad_output_becomes_invalid_action_with_reason(text, reason):
    parsed = parse_response(text, {"kept": "yes"}, HOSTS)
    assert parsed.action.kind == "invalid"
    assert reason in parsed.action.reason
    assert parsed.memory["kept"] == "yes"


def test_memory_accumulates_and_values_become_text():
    parsed = parse_response(ok({"kind": "stop"}, memory={"b": 2, "c": {"d": 1}}), {"a": "1", "b": "0"}, HOSTS)
    assert parsed.memory == {"a": "1", "b": "2", "c": '{"d": 1}'}


def test_braces_inside_strings_do_not_confuse_the_scanner():
    parsed = parse_response('{"thought": "a \\" } {", "action": {"kind": "stop"}}', {}, HOSTS)
    assert parsed.action.kind == "stop" and parsed.thought == 'a " } {'


def test_describe_is_compact():
    assert describe(parse_response(ok({"kind": "click", "mark": 7}), {}, HOSTS).action) == "click(mark=7)"


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=400))
def test_arbitrary_text_never_raises(text):
    assert parse_response(text, {}, HOSTS).action.kind in {
        "click", "type", "press", "scroll", "goto", "answer", "stop", "invalid"}
