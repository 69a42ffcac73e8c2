"""Scripted oracle for a subset of MiniWoB++ tasks: utterance + Set-of-Mark marks -> next plan step.

`oracle_plan_step(task_name, utterance, marks, step)` is pure: it parses the utterance (the page's
`#query` text), looks the needed elements up in `marks`, and returns one plan step in the oracle
vocabulary that `rollout.policy.oracle` resolves against the page:

    {"op": "click", "name": ..., ["role": ...]}   {"op": "type", "name": ..., "text": ...}
    {"op": "select", "name": ..., "text": ...}     {"op": "press", "key": "Enter"}   {"op": "stop"}

Names are taken from the marks themselves whenever the element can be found (so they match whatever
the marks extractor calls an unlabelled input), with a literal fallback otherwise. Multi-step
solutions are indexed by `step`; past the end of a plan the oracle stops (MiniWoB ends the episode
itself on the final click, so a `stop` is only reached if something went wrong).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from schemas.observation import Mark

INPUT_ROLES = frozenset({"input", "textbox", "text", "searchbox", "password", "textarea"})
STOP: dict = {"op": "stop"}
_ORDINALS = {"1st": 0, "2nd": 1, "3rd": 2, "4th": 3, "5th": 4}


# --- utterance parsing ----------------------------------------------------------------------


def _quoted(utterance: str) -> list[str]:
    return re.findall(r'"([^"]*)"', utterance)


def _first_quoted(utterance: str) -> str:
    q = _quoted(utterance)
    if not q:
        raise ValueError(f"no quoted text in utterance {utterance!r}")
    return q[0]


# --- mark lookup ----------------------------------------------------------------------------


def _norm(s: str) -> str:
    return " ".join(s.split())


def _named(marks: Sequence[Mark], name: str, role: str | None = None) -> Mark | None:
    """The first mark with this name, preferring the given role; case-sensitive first, because
    MiniWoB compares text exactly (click-link may show both "eget" and "Eget").

    The role preference matters where a container shares its child's text (click-collapsible's
    accordion turns the <p> around Submit into a header named "Submit")."""
    for key in (_norm, lambda s: _norm(s).casefold()):
        same = [m for m in marks if key(m.name) == key(name)]
        if same:
            return next((m for m in same if m.role == role), same[0])
    return None


def _inputs(marks: Sequence[Mark]) -> list[Mark]:
    """Text-entry marks, top to bottom (MiniWoB forms are single-column)."""
    return sorted((m for m in marks if m.role in INPUT_ROLES), key=lambda m: (m.y, m.x))


def _click(marks: Sequence[Mark], name: str, role: str | None = None) -> dict:
    m = _named(marks, name, role)
    step = {"op": "click", "name": m.name if m else name}
    if role:
        step["role"] = role
    return step


def _click_mark(m: Mark | None, fallback: str) -> dict:
    if m is None:
        return {"op": "click", "name": fallback}
    return {"op": "click", "name": m.name, "role": m.role}


def _type_nth(marks: Sequence[Mark], i: int, text: str, fallback: str) -> dict:
    inputs = _inputs(marks)
    name = inputs[i].name if i < len(inputs) and inputs[i].name else fallback
    return {"op": "type", "name": name, "text": text}


def _nth(plan: list[dict], step: int) -> dict:
    return plan[step] if 0 <= step < len(plan) else STOP


def _close_button(marks: Sequence[Mark]) -> dict:
    """jQuery UI's dialog "x" is a button whose text and title are "Close"."""
    for name in ("Close", "×", "x"):
        m = _named(marks, name)
        if m is not None:
            return _click_mark(m, "Close")
    return {"op": "click", "name": "Close"}


# --- per-task plans: (utterance, marks, step) -> step dict -----------------------------------

Plan = Callable[[str, Sequence[Mark], int], dict]


def _plan_click_quoted(u: str, marks: Sequence[Mark], step: int) -> dict:
    return _nth([_click(marks, _first_quoted(u))], step)


def _plan_click_button_word(u: str, marks: Sequence[Mark], step: int) -> dict:
    # "Click button ONE." / "Click button ONE, then click button TWO."
    words = re.findall(r"button (\w+)", u)
    return _nth([_click(marks, w, "button") for w in words], step)


def _plan_click_test(u: str, marks: Sequence[Mark], step: int) -> dict:
    return _nth([_click(marks, "Click Me!", "button")], step)


def _plan_click_dialog(u: str, marks: Sequence[Mark], step: int) -> dict:
    return _nth([_close_button(marks)], step)


def _plan_click_dialog_2(u: str, marks: Sequence[Mark], step: int) -> dict:
    label = _first_quoted(u)
    first = _close_button(marks) if label == "x" else _click(marks, label, "button")
    return _nth([first], step)


def _plan_click_tab(u: str, marks: Sequence[Mark], step: int) -> dict:
    n = re.search(r"Tab #(\d+)", u).group(1)
    return _nth([_click(marks, f"Tab #{n}")], step)


def _plan_click_tab_2(u: str, marks: Sequence[Mark], step: int) -> dict:
    """Tab #1 is open at the start; step s opens Tab #(s+2) until the link shows (hidden tabs have
    no box, so they yield no marks)."""
    link = _named(marks, _first_quoted(u))
    if link is not None:
        return _click_mark(link, link.name)
    tab = _named(marks, f"Tab #{step + 2}")
    return _click_mark(tab, f"Tab #{step + 2}") if tab is not None else STOP


def _plan_focus_text(u: str, marks: Sequence[Mark], step: int) -> dict:
    m = re.search(r"(\d+(?:st|nd|rd|th)) input", u)
    i = _ORDINALS.get(m.group(1), 0) if m else 0
    inputs = _inputs(marks)
    target = inputs[i] if i < len(inputs) else None
    return _nth([_click_mark(target, "")], step)


def _plan_enter_text(u: str, marks: Sequence[Mark], step: int) -> dict:
    text = _first_quoted(u)
    if "lower case" in u:
        text = text.lower()
    elif "upper case" in u:
        text = text.upper()
    return _nth([_type_nth(marks, 0, text, "tt"), _click(marks, "Submit", "button")], step)


def _plan_enter_password(u: str, marks: Sequence[Mark], step: int) -> dict:
    pw = _first_quoted(u)
    plan = [
        _type_nth(marks, 0, pw, "password"),
        _type_nth(marks, 1, pw, "verify"),
        _click(marks, "Submit", "button"),
    ]
    return _nth(plan, step)


def _plan_login_user(u: str, marks: Sequence[Mark], step: int) -> dict:
    user, pw = _quoted(u)[:2]
    plan = [
        _type_nth(marks, 0, user, "username"),
        _type_nth(marks, 1, pw, "password"),
        _click(marks, "Login", "button"),
    ]
    return _nth(plan, step)


def _plan_select_and_submit(u: str, marks: Sequence[Mark], step: int) -> dict:
    # click-checkboxes / click-option: "Select a, b and click Submit." or "Select nothing and ..."
    items = re.match(r"Select (.*) and click Submit", u).group(1)
    names = [] if items == "nothing" else [s.strip() for s in items.split(",")]
    return _nth([_click(marks, n) for n in names] + [_click(marks, "Submit", "button")], step)


def _plan_choose_list(u: str, marks: Sequence[Mark], step: int) -> dict:
    option = re.match(r"Select (.*) from the list", u).group(1)
    select = next((m for m in marks if m.role in ("select", "combobox", "listbox")), None)
    name = select.name if select is not None else "options"
    plan = [{"op": "select", "name": name, "text": option}, _click(marks, "Submit", "button")]
    return _nth(plan, step)


def _plan_collapsible(u: str, marks: Sequence[Mark], step: int) -> dict:
    # The accordion starts collapsed; Submit only pays once the section's content is visible.
    header = next((m for m in marks if m.name.startswith("Section #")), None)
    return _nth([_click_mark(header, "Section"), _click(marks, "Submit", "button")], step)


PLANS: dict[str, Plan] = {
    "click-test": _plan_click_test,
    "click-test-2": _plan_click_button_word,
    "click-button-sequence": _plan_click_button_word,
    "click-button": _plan_click_quoted,
    "unicode-test": _plan_click_quoted,
    "click-link": _plan_click_quoted,
    "click-dialog": _plan_click_dialog,
    "click-dialog-2": _plan_click_dialog_2,
    "click-tab": _plan_click_tab,
    "click-tab-2": _plan_click_tab_2,
    "focus-text": _plan_focus_text,
    "focus-text-2": _plan_focus_text,
    "enter-text": _plan_enter_text,
    "enter-text-2": _plan_enter_text,
    "enter-password": _plan_enter_password,
    "login-user": _plan_login_user,
    "click-checkboxes": _plan_select_and_submit,
    "click-option": _plan_select_and_submit,
    "choose-list": _plan_choose_list,
    "click-collapsible-nodelay": _plan_collapsible,
}
ORACLE_TASKS = frozenset(PLANS)
"""MiniWoB++ tasks the oracle solves (documented in TASKS.md)."""


def oracle_plan_step(task_name: str, utterance: str, marks: Sequence[Mark], step: int) -> dict:
    """The next plan step for `task_name`; `{"op": "stop"}` for tasks outside `ORACLE_TASKS`."""
    plan = PLANS.get(task_name)
    if plan is None:
        return dict(STOP)
    return dict(plan(utterance, marks, step))
