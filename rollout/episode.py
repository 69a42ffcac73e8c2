"""One episode: screenshot -> policy -> parse -> execute -> settle -> feedback, until done or horizon.

Every step becomes a `StepRecorded` (pixels go to the store by hash first, so no event ever names a
screenshot that was not stored). Browser failures end the episode as `env_error` with the reason; the
caller restarts the browser. Running out of horizon is an ordinary failure, as in the papers. With a
model judge (`EpisodeConfig.judge`), its verdict on the finished trajectory is the reward, recorded
with the rule judge's beside it (`TrajectoryJudged`); no verdict ends the episode as `judge_error`.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal

from rollout.actions import describe, parse_response
from rollout.browser import BrowserWorker
from rollout.execute import BrowserScreen
from rollout.judges import JudgeInput, Judgement, ModelJudge, ModelJudgeConfig, history_line, judged_event
from rollout.types import Policy, Screen, Suite, Verdict
from schemas import EpisodeFinished, EpisodeStarted, Event, StepMark, StepRecorded, StepTimings
from schemas.observation import Observation, PastStep, Task


@dataclass(frozen=True)
class EpisodeConfig:
    som: bool = False
    """Set-of-Mark observations (marks drawn and listed); pure pixels otherwise (the paper's setting)."""
    screenshots_k: int = 1
    """Screenshots in each prompt (OpenWebRL: K=1; a second gave no consistent gain)."""
    step_timeout_s: float = 60.0
    """A step (policy + browser) taking longer means a hung browser or policy: env_error."""
    allowed_hosts: frozenset[str] = frozenset({"127.0.0.1", "localhost"})
    """Hosts `goto` may open."""
    max_invalid_streak: int | None = 3
    """End the episode as a failure after this many consecutive invalid actions (WebArena's parsing-
    failure stop): a policy that cannot produce an action does not burn its whole horizon at full
    generation length. None: run the horizon."""
    malformed_reward: float = 0.0
    """Reward of a failed episode with a malformed action (output that is not an action, or a mark not
    on the screen). Below a wrong click's 0, it ranks a well-formed mistake above lost format, so
    that RL keeps the format it is given and a group that fails alike in different ways still teaches."""
    judge: Literal["rule", "model"] = "rule"
    """Which judge gives the reward: the suite's rule, or the model judge (`model_judge`), whose verdict
    is recorded with the rule's beside it (`TrajectoryJudged`, the `verdicts` view)."""
    model_judge: ModelJudgeConfig = field(default_factory=ModelJudgeConfig)
    """The model judge's endpoint, model, screenshots and prompt (`rollout.judges`), when `judge` is model."""


MALFORMED = frozenset({"invalid_action", "no_such_mark"})
"""Step errors of output that is not an action on this screen (`EpisodeConfig.malformed_reward`)."""


class PolicyLoadError(RuntimeError):
    """A published version could not be loaded: the pool's failure, not the environment's, so it is not
    an episode's `env_error` but ends the pool (whose groups another pool runs again)."""


@dataclass
class EpisodeContext:
    """What an episode needs from the pool around it."""

    run_id: str
    worker: BrowserWorker
    policy: Policy
    suite: Suite
    emit: Callable[[Event], None]
    put_screenshot: Callable[[bytes], Awaitable[str]]
    refresh: Callable[[], Awaitable[None]]
    """Called between steps: loads a newer policy version in place if one was published (raises
    `PolicyLoadError` if it cannot)."""
    config: EpisodeConfig
    judge: ModelJudge | None = None
    """The model judge that gives the reward (`config.judge` model); None: the suite's rule."""


async def run_episode(ctx: EpisodeContext, task: Task, group_id: str) -> EpisodeFinished:
    tid = uuid.uuid4().hex
    ids = dict(run_id=ctx.run_id, trajectory_id=tid, group_id=group_id, task_id=task.task_id)
    screen: Screen | None = None
    steps = 0
    started = False
    recorded = [0, 0]  # steps emitted so far (also when the browser dies mid-episode), malformed ones
    seen = Seen(deque(maxlen=max(ctx.config.model_judge.screenshots, 1)))

    def start(instruction: str) -> None:
        nonlocal started
        ctx.emit(
            EpisodeStarted(
                **ids,
                worker_id=ctx.worker.worker_id,
                instruction=instruction,
                horizon=task.horizon,
                policy_version=ctx.policy.version,
            )
        )
        started = True

    try:
        screen = await _open(ctx)
        instruction = await asyncio.wait_for(ctx.suite.reset(screen.page, task), ctx.config.step_timeout_s)
        await screen.settle()
        start(instruction)
        verdict, answer = await _loop(ctx, screen, task, instruction, ids, recorded, seen)
        steps = verdict[1]
        outcome = "success" if verdict[0].success else "failure"
        reason = verdict[0].reason
    except PolicyLoadError:
        raise
    except Exception as exc:  # the browser died or hung: the environment failed, not the agent
        ctx.worker.kill()
        outcome, reason, answer = "env_error", f"{type(exc).__name__}: {(str(exc) or '-').splitlines()[0][:300]}", None
        steps = recorded[0]
        if not started:
            start(task.instruction)
    finally:
        if screen is not None:
            await screen.close()
    if ctx.judge is not None and outcome != "env_error":  # judged with the browser already released
        seen_input = JudgeInput(instruction, answer, seen.history, list(seen.screenshots))
        outcome, reason = await _model_verdict(ctx, ids, verdict[0], seen_input)
    reward = 1.0 if outcome == "success" else ctx.config.malformed_reward if recorded[1] else 0.0
    finished = EpisodeFinished(**ids, outcome=outcome, reward=reward, num_steps=steps, reason=reason, answer=answer)
    ctx.emit(finished)
    return finished


@dataclass
class Seen:
    """What a judge sees of the trajectory as it runs: the last screenshots, and one line per step."""

    screenshots: deque[bytes]
    history: list[str] = field(default_factory=list)


async def _model_verdict(ctx: EpisodeContext, ids: dict, rule: Verdict, inp: JudgeInput) -> tuple[str, str]:
    """The model judge's (outcome, reason); both verdicts recorded, the rule's for agreement only."""
    judged = await ctx.judge.judge(inp)
    ctx.emit(judged_event(ids, "rule", Judgement(rule.success, rule.reason), gives_reward=False))
    ctx.emit(judged_event(ids, "model", judged, gives_reward=True, judge=ctx.judge))
    if judged.success is None:
        return "judge_error", judged.reason
    return ("success" if judged.success else "failure"), judged.reason


async def _open(ctx: EpisodeContext) -> Screen:
    """A synthetic suite draws its own screens (no browser); a web suite gets a fresh browser context."""
    if not ctx.suite.needs_browser:
        return ctx.suite.new_screen()
    return await BrowserScreen.open(ctx.worker)


async def _loop(
    ctx: EpisodeContext, screen: Screen, task: Task, instruction: str, ids: dict, recorded: list[int], seen: Seen
):
    cfg = ctx.config
    history: list[PastStep] = []
    memory: dict[str, str] = {}
    feedback = ""
    shots: deque[tuple[bytes, str]] = deque(maxlen=cfg.screenshots_k)
    invalid_streak = 0
    for step in range(task.horizon):
        await ctx.refresh()
        png, marks = await asyncio.wait_for(screen.observe(cfg.som), cfg.step_timeout_s)
        sha = await ctx.put_screenshot(png)
        shots.append((png, sha))
        seen.screenshots.append(png)
        obs = Observation(
            instruction=instruction,
            screenshots=[s[0] for s in shots],
            screenshot_sha256=[s[1] for s in shots],
            url=screen.url,
            feedback=feedback,
            history=list(history),
            memory=dict(memory),
            marks=marks,
            som=cfg.som,
            step=step,
            horizon=task.horizon,
            task=task,
            viewport=screen.viewport,
        )
        t0 = time.perf_counter()
        version = ctx.policy.version
        out = await asyncio.wait_for(ctx.policy.act(obs), cfg.step_timeout_s)
        policy_s = time.perf_counter() - t0
        parsed = parse_response(out.response_text, memory, cfg.allowed_hosts, obs.viewport)
        done = await asyncio.wait_for(screen.execute(parsed.action, marks), cfg.step_timeout_s)
        ctx.emit(
            StepRecorded(
                **ids,
                step=step,
                screenshot_sha256=sha,
                url=obs.url,
                action=parsed.action,
                response_text=_encodable(out.response_text),
                memory=parsed.memory,
                prompt_token_ids=out.prompt_token_ids,
                prompt_screenshot_sha256=obs.screenshot_sha256,
                response_token_ids=out.response_token_ids,
                behave_logprobs=out.logprobs,
                token_policy_versions=out.token_policy_versions,
                policy_version=version,
                env_feedback=done.feedback,
                error_class=done.error_class,
                timings=StepTimings(policy_s=policy_s, browser_s=done.browser_s, wait_s=done.wait_s),
                marks=[
                    StepMark(
                        id=m.id, role=m.role, name=_encodable(m.name), x=m.x, y=m.y, width=m.width, height=m.height
                    )
                    for m in marks
                ],
                marks_drawn=cfg.som,
            )
        )
        recorded[0] += 1
        recorded[1] += done.error_class in MALFORMED
        history.append(PastStep(parsed.thought, parsed.memory, describe(parsed.action), done.feedback))
        seen.history.append(history_line(step, parsed.thought, describe(parsed.action), done.feedback))
        memory, feedback = parsed.memory, done.feedback
        if parsed.action.kind in ("answer", "stop"):
            answer = parsed.action.text if parsed.action.kind == "answer" else ""
            verdict = await ctx.suite.judge(screen.page, task, answer, final=True)
            return (verdict, step + 1), answer
        verdict = await ctx.suite.judge(screen.page, task, None, final=False)
        if verdict is not None:
            return (verdict, step + 1), None
        invalid_streak = invalid_streak + 1 if parsed.action.kind == "invalid" else 0
        if cfg.max_invalid_streak is not None and invalid_streak >= cfg.max_invalid_streak:
            return (Verdict(False, f"{invalid_streak} invalid actions in a row"), step + 1), None
    return (Verdict(False, f"horizon of {task.horizon} steps reached"), task.horizon), None


def _encodable(text: str) -> str:
    """Model output as recorded: a lone surrogate (which no JSON encoder accepts) becomes `?`."""
    return text if text.isascii() else text.encode("utf-8", "replace").decode("utf-8")
