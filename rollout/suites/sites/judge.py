"""Rule judges for the sites, from a task's `judge` parameters and the session state (`/__state`).

Kinds:
- `cart`:   `expect` = ["sku-12:1", ...]; the cart must hold exactly these items and quantities.
- `order`:  `expect` as for cart; the latest placed order must hold exactly these.
- `form`:   `form` = form id, `expect` = ["field=value", ...]; the latest submission of that form
            must have these values (case- and whitespace-insensitive).
- `answer`: `expect` = the answer; `reject` = distractors that must not appear (so listing every
            candidate fails). Numbers compare numerically ("$1,250.00" == "1250"); the answer must
            then contain exactly one number. Text matches whole words, case- and article-insensitive.
"""

from __future__ import annotations

import re

from rollout.types import Verdict
from schemas.observation import Task

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def judge_task(task: Task, state: dict, answer: str | None) -> Verdict:
    kind = task.judge.get("kind")
    if kind == "answer":
        return judge_answer(answer or "", str(task.judge["expect"]), _strings(task.judge.get("reject", [])))
    if kind == "cart":
        return _items("cart", state.get("cart", {}), _strings(task.judge["expect"]))
    if kind == "order":
        orders = state.get("orders", [])
        if not orders:
            return Verdict(False, "no order was placed")
        return _items("latest order", orders[-1]["items"], _strings(task.judge["expect"]))
    if kind == "form":
        return _form(state.get("submissions", []), str(task.judge["form"]), _strings(task.judge["expect"]))
    raise ValueError(f"task {task.task_id}: unknown judge kind {kind!r}")


def _strings(value) -> list[str]:
    return [value] if isinstance(value, str) else [str(v) for v in value]


def _fmt(items: dict[str, int]) -> str:
    return ", ".join(f"{k} x{v}" for k, v in sorted(items.items())) or "nothing"


def _items(what: str, got: dict[str, int], expect: list[str]) -> Verdict:
    want = {sku: int(qty) for sku, qty in (e.rsplit(":", 1) for e in expect)}
    if got == want:
        return Verdict(True, f"{what} holds exactly {_fmt(want)}")
    return Verdict(False, f"{what} holds {_fmt(got)}; expected {_fmt(want)}")


def _norm(text: str) -> str:
    text = re.sub(r"(?<=\d),(?=\d{3})", "", text.lower())  # 1,250 -> 1250
    text = re.sub(r"[^\w.\s-]", " ", text)
    return " ".join(w.strip(".") for w in text.split() if w.strip(".") not in ("the", "a", "an", ""))


def _numbers(text: str) -> list[float]:
    return [float(n) for n in _NUMBER.findall(_norm(text).replace("$", ""))]


def _has(hay: str, needle: str) -> bool:
    return bool(needle) and re.search(rf"(?<!\w){re.escape(needle)}(?!\w)", hay) is not None


def judge_answer(answer: str, expect: str, reject: list[str]) -> Verdict:
    if not answer.strip():
        return Verdict(False, f"no answer given; expected {expect!r}")
    got = _norm(answer)
    wrong = [r for r in reject if _has(got, _norm(r))]
    if wrong:
        return Verdict(False, f"answer {answer!r} mentions {wrong[0]!r}; expected {expect!r}")
    if _NUMBER.fullmatch(_norm(expect)):
        nums = _numbers(answer)
        ok = len(nums) == 1 and abs(nums[0] - float(_norm(expect))) < 1e-6
    else:
        ok = _has(got, _norm(expect))
    if ok:
        return Verdict(True, f"answer {answer!r} matches {expect!r}")
    return Verdict(False, f"answer {answer!r} does not match {expect!r}")


def _form(submissions: list[dict], form: str, expect: list[str]) -> Verdict:
    mine = [s for s in submissions if s.get("form") == form]
    if not mine:
        return Verdict(False, f"form {form!r} was not submitted")
    values = mine[-1]["values"]
    for e in expect:
        key, want = e.split("=", 1)
        got = str(values.get(key, ""))
        if " ".join(got.lower().split()) != " ".join(want.lower().split()):
            return Verdict(False, f"form {form!r}: {key} is {got!r}; expected {want!r}")
    return Verdict(True, f"form {form!r} submitted with the expected {len(expect)} values")
