"""Policies without a model: the scripted oracle (demonstrations, tests) and a uniform random baseline.

The oracle asks the task's suite for its next plan step (`Suite.oracle_step`) and resolves it against
the page's marks: by mark id in Set-of-Mark mode, by the element's centre pixel otherwise. Its output
goes through the same parser as a model's, so demonstrations exercise the real action path.
"""

from __future__ import annotations

import dataclasses
import json
import random
from urllib.parse import urljoin

from rollout.types import Suite
from schemas.observation import Mark, Observation, PolicyOutput


class OraclePolicy:
    name = "oracle"

    def __init__(self, suites: dict[str, Suite], version: int = 0):
        self.suites = suites
        self.version = version

    async def act(self, obs: Observation) -> PolicyOutput:
        assert obs.task is not None, "the oracle needs the task (its scripted plan)"
        # Scrolls the oracle inserted to bring an element into view are not plan steps.
        scrolls = sum(1 for h in obs.history if h.thought.startswith("oracle: scroll"))
        step = self.suites[obs.task.suite].oracle_step(dataclasses.replace(obs, step=obs.step - scrolls))
        thought, action = _resolve(step, obs)
        memory = {"plan step": str(obs.step - scrolls)}
        return _scripted_output(json.dumps({"thought": thought, "memory": memory, "action": action}), self.version)

    async def refresh(self, version: int, checkpoint_uri: str, checkpoint_sha256: str | None = None) -> None:
        self.version = version


def _resolve(step: dict, obs: Observation) -> tuple[str, dict]:
    op = step.get("op")
    if op in ("click", "type", "select"):
        by_id = next((m for m in obs.marks if m.id == step["mark"]), None) if "mark" in step else None
        mark = by_id or _find(obs.marks, str(step.get("name", "")), step.get("role"))
        if mark is None:
            return "oracle: scroll to find " + str(step.get("name")), {"kind": "scroll", "dx": 0, "dy": 300}
        target = {"mark": mark.id} if obs.som else dict(zip(("x", "y"), mark.center))
        if op == "click":
            return str(step.get("thought") or f"oracle: click {mark.name}"), {"kind": "click", **target}
        return f"oracle: {op} into {mark.name}", {"kind": "type", "text": str(step["text"]), **target}
    if op == "press":
        return "oracle: press", {"kind": "press", "key": str(step["key"])}
    if op == "goto":
        return "oracle: goto", {"kind": "goto", "url": urljoin(obs.url, str(step["path"]))}
    if op == "answer":
        return "oracle: answer", {"kind": "answer", "text": str(step["text"])}
    return "oracle: done", {"kind": "stop"}


def _find(marks: list[Mark], name: str, role: str | None) -> Mark | None:
    candidates = [m for m in marks if role is None or m.role == role] or marks
    # Case matters first: MiniWoB++ shows "ok" and "Ok" side by side.
    for same in (lambda a, b: a == b, lambda a, b: a.lower() == b.lower(), lambda a, b: a.lower() in b.lower()):
        found = [m for m in candidates if name.strip() and same(name.strip(), m.name.strip())]
        if found:
            return found[0]
    return None


class RandomPolicy:
    """Uniform over a few action kinds; a floor for success rates and a fuzzer for the env."""

    name = "random"

    def __init__(self, seed: int = 0, version: int = 0):
        self.rng = random.Random(seed)
        self.version = version

    async def act(self, obs: Observation) -> PolicyOutput:
        w, h = obs.viewport
        r = self.rng
        kind = r.choices(["click", "click_mark", "type", "scroll", "press", "stop"], [4, 4, 1, 1, 1, 0.3])[0]
        if kind == "click_mark" and obs.marks:
            action = {"kind": "click", "mark": r.choice(obs.marks).id}
        elif kind == "type":
            action = {"kind": "type", "text": r.choice(["hello", "test", "42"])}
        elif kind == "scroll":
            action = {"kind": "scroll", "dx": 0, "dy": r.choice([-300, 300])}
        elif kind == "press":
            action = {"kind": "press", "key": r.choice(["Enter", "Tab"])}
        elif kind == "stop":
            action = {"kind": "stop"}
        else:
            action = {"kind": "click", "x": r.randrange(w), "y": r.randrange(h)}
        return _scripted_output(json.dumps({"thought": "random", "memory": {}, "action": action}), self.version)

    async def refresh(self, version: int, checkpoint_uri: str, checkpoint_sha256: str | None = None) -> None:
        self.version = version


def _scripted_output(text: str, version: int) -> PolicyOutput:
    """Scripted policies have no tokens: empty token fields, exact text."""
    return PolicyOutput(
        response_text=text, prompt_token_ids=[], response_token_ids=[], logprobs=[], token_policy_versions=[]
    )
