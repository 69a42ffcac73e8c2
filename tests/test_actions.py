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


@pytest.mark.parametrize(
    "action",
    [
        {"kind": "click", "x": 10, "y": 20},
        {"kind": "click", "mark": 3},
        {"kind": "type", "text": "hi"},
        {"kind": "type", "text": "hi", "mark": 2},
        {"kind": "press", "key": "Enter"},
        {"kind": "scroll", "dx": 0, "dy": 300},
        {"kind": "goto", "url": "http://127.0.0.1:8000/cart"},
        {"kind": "answer", "text": "Paris"},
        {"kind": "stop"},
    ],
)
def test_valid_actions_parse(action):
    parsed = parse_response("Sure!\n```json\n" + ok(action) + "\n```", {}, HOSTS)
    assert parsed.action.model_dump(exclude_none=True) == action
    assert parsed.thought == "t" and parsed.memory == {"k": "v"}


@pytest.mark.parametrize(
    "text, reason",
    [
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
        # nothing usable at all
        ("   \n\t ", "no JSON object"),
        ("[1, 2]", "no JSON object"),
        ('[{"kind": "stop"}]', "missing 'action'"),  # the object inside is not an action envelope
        ("42", "no JSON object"),
        ('"stop"', "no JSON object"),
        ("null", "no JSON object"),
        ('{"action": "click"}', "missing 'action'"),
        ('{"action": [{"kind": "stop"}]}', "missing 'action'"),
        ("{" * 40_000, "longer than"),
        ("{" * 30_000, "no JSON object"),
        ('{"a": ' * 3000 + "1" + "}" * 3000, "no JSON object"),  # nested past the recursion limit
        ("x" * (1 << 20), "longer than"),
        (ok({"kind": "stop"}, thought="y" * (1 << 20)), "longer than"),
        # wrong kinds, missing or mistyped fields
        (ok({"x": 1, "y": 2}), "kind"),
        (ok({"kind": 3}), "bad action"),
        (ok({"kind": "type"}), "needs text"),
        (ok({"kind": "goto"}), "needs url"),
        (ok({"kind": "scroll", "dy": 10}), "needs dx"),
        (ok({"kind": "press", "key": 13}), "key"),
        (ok({"kind": "click", "x": True, "y": 2}), "boolean"),
        (ok({"kind": "click", "x": 1.5, "y": 2}), "bad action"),
        (ok({"kind": "goto", "url": ["http://127.0.0.1/"]}), "url"),
        ('{"action": {"kind": "click", "x": ' + "9" * 5000 + ', "y": 1}}', "no JSON object"),
        # coordinates
        (ok({"kind": "click", "x": -1, "y": 2}), "out of range"),
        (ok({"kind": "click", "x": 1, "y": 10**12}), "out of range"),
        ('{"action": {"kind": "click", "x": NaN, "y": 2}}', "finite"),
        ('{"action": {"kind": "click", "x": 1, "y": -Infinity}}', "finite"),
        (ok({"kind": "click", "mark": -3}), "negative"),
        (ok({"kind": "scroll", "dx": 0, "dy": 10**9}), "scrolls more than"),
        # a goto anywhere but the task's own hosts
        (ok({"kind": "goto", "url": "javascript:alert(1)"}), "not allowed"),
        (ok({"kind": "goto", "url": "http://evil.example/"}), "not allowed"),
        (ok({"kind": "goto", "url": "chrome://settings"}), "not allowed"),
        (ok({"kind": "goto", "url": "file://127.0.0.1/etc/passwd"}), "not allowed"),
        (ok({"kind": "goto", "url": "ftp://127.0.0.1/"}), "not allowed"),
        (ok({"kind": "goto", "url": "data:text/html,<script>1</script>"}), "not allowed"),
        (ok({"kind": "goto", "url": "http://127.0.0.1@evil.example/"}), "not allowed"),
        (ok({"kind": "goto", "url": "http://evil.example\\@127.0.0.1/"}), "not allowed"),  # a browser goes to evil
        (ok({"kind": "goto", "url": " http://evil.example/"}), "not allowed"),
        (ok({"kind": "goto", "url": "http://[::1/"}), "not allowed"),
        (ok({"kind": "goto", "url": "http://127.0.0.1:99999/"}), "not allowed"),
        (ok({"kind": "goto", "url": "//evil.example/"}), "not allowed"),
        # text no event could carry, or no keyboard should type
        (ok({"kind": "type", "text": "a\x00b"}), "control characters"),
        (ok({"kind": "press", "key": "\x1b[A"}), "control characters"),
        (ok({"kind": "answer", "text": "\ud800"}), "lone surrogates"),
        (ok({"kind": "goto", "url": "http://127.0.0.1/\x07"}), "control characters"),
    ],
    ids=lambda v: ascii(v)[:60],
)
def test_bad_output_becomes_invalid_action_with_reason(text, reason):
    parsed = parse_response(text, {"kept": "yes"}, HOSTS)
    assert parsed.action.kind == "invalid"
    assert reason in parsed.action.reason
    assert parsed.memory["kept"] == "yes"


def test_coordinates_must_be_on_the_screen_when_its_size_is_known():
    def action(x, y):
        return parse_response(ok({"kind": "click", "x": x, "y": y}), {}, HOSTS, viewport=(1280, 720)).action

    assert (action(0, 0).kind, action(1279, 719).kind) == ("click", "click")
    assert "off the 1280x720 screen" in action(1280, 10).reason
    assert "off the 1280x720 screen" in action(10, 720).reason


def test_lone_surrogates_in_thought_and_memory_are_replaced_so_the_step_can_be_recorded():
    parsed = parse_response(
        '{"thought": "\\ud800", "memory": {"\\udc00": "a\\ud83d"}, "action": {"kind": "stop"}}', {}, HOSTS
    )
    assert parsed.action.kind == "stop"
    assert (parsed.thought, parsed.memory) == ("\ufffd", {"\ufffd": "a\ufffd"})
    json.dumps(parsed.memory, ensure_ascii=False).encode()


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
        "click",
        "type",
        "press",
        "scroll",
        "goto",
        "answer",
        "stop",
        "invalid",
    }


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)
URLS = st.sampled_from(
    [
        "http://127.0.0.1/",
        "https://127.0.0.1:8000/a",
        "http://evil.example/",
        "file:///x",
        "javascript:1",
        "http://127.0.0.1@evil.example/",
        "//127.0.0.1/",
        "http://[::1",
    ]
)
ACTIONS = st.fixed_dictionaries(
    {"kind": st.sampled_from(["click", "type", "press", "scroll", "goto", "answer", "stop", "invalid", "fly"])},
    optional={f: JSON_VALUES for f in ("x", "y", "mark", "text", "key", "dx", "dy", "reason")} | {"url": URLS},
)


@settings(max_examples=200, deadline=None)
@given(ACTIONS, JSON_VALUES, JSON_VALUES)
def test_arbitrary_actions_never_raise_and_every_goto_kept_stays_on_an_allowed_host(action, thought, memory):
    parsed = parse_response(json.dumps({"thought": thought, "memory": memory, "action": action}), {}, HOSTS)
    a = parsed.action
    assert (a.kind == "invalid") == bool(a.reason)
    if a.kind == "goto":
        assert a.url.startswith(("http://127.0.0.1/", "https://127.0.0.1:8000/"))
    if a.kind in ("click", "type") and a.x is not None:
        assert a.x >= 0 and a.y >= 0
