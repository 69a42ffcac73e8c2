"""Judges of a trajectory: the suite's rule (`Suite.judge`, in the episode loop) and a model judge.

The model judge is OpenWebRL's (arXiv 2606.02031): a model that sees the instruction, the
final answer, the last K screenshots and the whole text history, and answers success or failure with
a reason. Any OpenAI-compatible chat endpoint serves it: the local vLLM server, a GPU deployment's, or
a provider's. Its findings are why every verdict is recorded (`TrajectoryJudged`): a distilled judge
agreed with a stronger one 89.8% of the time and trained as well, while a weaker judge was
reward-hacked, so a user must be able to measure the judge that gives the reward against another.

A judge that is down, slow, refuses or answers something unparseable never turns into a silent
success or failure: it is tried `attempts` times with exponential back-off (tenacity), each failure
logged with its reason, then the trajectory ends as `judge_error` and the trainer drops its group.
A 4xx other than 408/429 is a request the server will never accept (a wrong model name, a missing
key) and is not retried.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import re
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from string import Template

from tenacity import AsyncRetrying, retry_if_not_exception_type, stop_after_attempt, wait_exponential

from rollout.policy.vllm_client import data_url
from schemas import TrajectoryJudged

log = logging.getLogger("awrl.judge")

JUDGE_VERSION = "1"
"""The model judge's code version (request, parsing): bump on a change that can change verdicts."""

DEFAULT_PROMPT = """You are judging whether a web agent completed a task.

Task: $instruction
The agent's final answer: $answer

What the agent did, one line per step (its thought, its action, what the page reported):
$history

The last $k screenshots of the page follow, oldest first.
Did the agent complete the task? Reply with JSON only:
{"success": true or false, "reason": "<one sentence>"}"""
"""OpenWebRL's judge inputs in one prompt (`string.Template`: `$instruction`, `$answer`, `$history`, `$k`)."""


@dataclass(frozen=True)
class ModelJudgeConfig:
    url: str = "http://127.0.0.1:8000"
    """Base URL of an OpenAI-compatible server; `/v1/chat/completions` is appended."""
    model: str = ""
    """The served model's name (the `model` of each request)."""
    screenshots: int = 3
    """K: the last K screenshots of the trajectory go with the prompt (0: text only)."""
    prompt: str = DEFAULT_PROMPT
    """The prompt template (`string.Template` over `$instruction`, `$answer`, `$history`, `$k`); its
    sha256 is recorded with every verdict."""
    max_tokens: int = 256
    """Longest answer; a reason longer than this is cut and may not parse (then it is retried)."""
    timeout_s: float = 60.0
    """One request's time limit: a slower judge is a failed attempt."""
    attempts: int = 3
    """Tries per trajectory (server down, 5xx, 408/429, timeout, unparseable answer) before `judge_error`."""
    api_key_env: str = "AWRL_JUDGE_API_KEY"
    """Environment variable holding a provider's key, sent as a bearer token when set."""

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"model_judge.attempts: must be at least 1, got {self.attempts}")
        if self.screenshots < 0:
            raise ValueError(f"model_judge.screenshots: must be at least 0, got {self.screenshots}")


@dataclass(frozen=True)
class JudgeInput:
    """What a judge sees of one finished trajectory."""

    instruction: str
    answer: str | None
    history: list[str]
    """One line per step."""
    screenshots: list[bytes]
    """The last screenshots, oldest first (PNG)."""


@dataclass(frozen=True)
class Judgement:
    """A judge's verdict, or why there is none (`success` None, `error` set)."""

    success: bool | None
    reason: str
    response_text: str = ""
    error: str | None = None
    attempts: int = 1
    latency_s: float = 0.0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


def history_line(step: int, thought: str, action: str, feedback: str) -> str:
    """One step as the judge reads it (the episode's and `awrl rejudge`'s alike): `action` is
    `rollout.actions.describe`'s text."""
    return f"{step + 1}. {thought} | {action} | {feedback}"


class UnparseableVerdict(ValueError):
    """The judge's answer holds no `{"success": bool, "reason": str}` object."""


class JudgeRefused(RuntimeError):
    """The server refused the request for good (a 4xx other than 408/429): retrying cannot help."""


_OBJECT = re.compile(r"\{.*?\}", re.DOTALL)


def parse_verdict(text: str) -> tuple[bool, str]:
    """(success, reason) from the first JSON object in `text` that has a boolean `success` (models wrap
    their JSON in prose or code fences); UnparseableVerdict otherwise."""
    for match in _OBJECT.finditer(text):
        try:
            obj = json.loads(match.group(0))
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict) and isinstance(obj.get("success"), bool):
            reason = obj.get("reason", "")
            return obj["success"], reason if isinstance(reason, str) else json.dumps(reason)
    raise UnparseableVerdict(f"no {{'success': bool, 'reason': str}} object in the answer: {text[:200]!r}")


class ModelJudge:
    """`judge(JudgeInput) -> Judgement` over an OpenAI-compatible chat endpoint (module docstring)."""

    name = "model"

    def __init__(self, config: ModelJudgeConfig):
        self.config = config
        self.prompt_sha256 = hashlib.sha256(config.prompt.encode()).hexdigest()

    def request_body(self, inp: JudgeInput) -> dict:
        cfg = self.config
        shots = inp.screenshots[-cfg.screenshots :] if cfg.screenshots else []
        text = Template(cfg.prompt).safe_substitute(
            instruction=inp.instruction,
            answer=inp.answer if inp.answer is not None else "(none: the agent did not answer)",
            history="\n".join(inp.history) or "(no steps)",
            k=len(shots),
        )
        content = [{"type": "text", "text": text}]
        content += [{"type": "image_url", "image_url": {"url": data_url(png)}} for png in shots]
        return {
            "model": cfg.model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": cfg.max_tokens,
            "temperature": 0.0,
        }

    async def judge(self, inp: JudgeInput) -> Judgement:
        body, t0, tries = self.request_body(inp), time.monotonic(), 0
        last_text = ""
        try:
            async for attempt in AsyncRetrying(
                stop=stop_after_attempt(self.config.attempts),
                wait=wait_exponential(multiplier=0.5, max=8.0),
                retry=retry_if_not_exception_type(JudgeRefused),
                before_sleep=lambda state: log.warning(
                    "judge attempt %d failed (%s), retrying", state.attempt_number, _describe(state.outcome.exception())
                ),
                reraise=True,
            ):
                with attempt:
                    tries += 1
                    reply = await asyncio.to_thread(self._post, body)
                    last_text = _content(reply)
                    success, reason = parse_verdict(last_text)
        except Exception as exc:  # noqa: BLE001 - every failure becomes a recorded judge_error
            error = _describe(exc)
            log.warning("judge gave no verdict after %d attempt(s): %s", tries, error)
            return Judgement(None, f"judge_error: {error}", last_text, error, tries, time.monotonic() - t0, None, None)
        usage = reply.get("usage") or {}
        return Judgement(
            success,
            reason,
            last_text,
            None,
            tries,
            time.monotonic() - t0,
            usage.get("prompt_tokens"),
            usage.get("completion_tokens"),
        )

    def _post(self, body: dict) -> dict:
        headers = {"Content-Type": "application/json"}
        if key := os.environ.get(self.config.api_key_env):
            headers["Authorization"] = f"Bearer {key}"
        req = urllib.request.Request(
            self.config.url.rstrip("/") + "/v1/chat/completions", json.dumps(body).encode(), headers
        )
        try:
            with urllib.request.urlopen(req, timeout=self.config.timeout_s) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            detail = exc.read()[:200].decode("utf-8", "replace")
            if 400 <= exc.code < 500 and exc.code not in (408, 429):
                raise JudgeRefused(f"HTTP {exc.code}: {detail}") from exc
            raise RuntimeError(f"HTTP {exc.code}: {detail}") from exc


def _content(reply: dict) -> str:
    try:
        content = reply["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError) as exc:
        raise UnparseableVerdict(f"not a chat completion: {json.dumps(reply)[:200]}") from exc
    return content if isinstance(content, str) else json.dumps(content)


def _describe(exc: BaseException | None) -> str:
    return f"{type(exc).__name__}: {(str(exc) or '-').splitlines()[0][:300]}"


def judged_event(
    ids: dict, name: str, j: Judgement, gives_reward: bool, judge: ModelJudge | None = None
) -> TrajectoryJudged:
    """`j` as the event that records it; `ids`: run, trajectory, group and task ids; `judge` None: the rule."""
    answer = j.response_text.encode("utf-8", "replace").decode("utf-8")  # no lone surrogate
    fields = {**asdict(j), "response_text": answer}
    return TrajectoryJudged(
        **ids,
        **fields,
        judge=name,
        judge_version=JUDGE_VERSION if judge is not None else "rule",
        gives_reward=gives_reward,
        model=judge.config.model if judge is not None else "",
        prompt_sha256=judge.prompt_sha256 if judge is not None else "",
    )
