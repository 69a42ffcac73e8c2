"""Synthetic but realistically sized events and screenshots, for the demo, tests and benchmarks.

A sample `StepRecorded` has the shape of a real one (~300 response tokens with log-probs, a 1-2k token
prompt, a memory object); a sample screenshot is a rendered 1280x720 PNG page. Real ones come from the
rollout pool; these exist so the pipeline can be exercised and measured on its own.
"""

from __future__ import annotations

import io
import random

from PIL import Image, ImageDraw

from schemas import (
    Action,
    EpisodeFinished,
    EpisodeStarted,
    GroupCompleted,
    PolicyVersionPublished,
    StepMark,
    StepRecorded,
    StepTimings,
    UpdateApplied,
)


def render_page(title: str, lines: int = 12, size: tuple[int, int] = (1280, 720), seed: int = 0) -> bytes:
    """A PNG that looks like a simple web page: header bar, title, text rows, a button."""
    rng = random.Random(seed)
    img = Image.new("RGB", size, "white")
    d = ImageDraw.Draw(img)
    d.rectangle([0, 0, size[0], 56], fill=(36, 41, 46))
    d.text((24, 20), "awrl-shop.local", fill="white")
    d.text((24, 80), title, fill="black")
    for i in range(lines):
        y = 120 + i * 36
        width = rng.randint(size[0] // 4, size[0] - 60)
        d.rectangle([24, y, 24 + width, y + 14], fill=(200, 200, 200))
        d.text((30, y), f"item {i}: {rng.random():.6f}", fill=(40, 40, 40))
    d.rectangle([1000, 640, 1200, 690], fill=(0, 110, 220))
    d.text((1040, 658), "Add to cart", fill="white")
    buf = io.BytesIO()
    img.save(buf, format="PNG", optimize=False, compress_level=1)
    return buf.getvalue()


def sample_step(
    run_id: str,
    group_id: str,
    trajectory_id: str,
    step: int,
    screenshot_sha256: str,
    response_tokens: int = 300,
    prompt_tokens: int = 1200,
    policy_version: int = 0,
    seed: int = 0,
) -> StepRecorded:
    rng = random.Random(seed)
    memory = {f"fact {k}": f"value {rng.randint(0, 99)}" for k in range(step % 5 + 1)}
    return StepRecorded(
        run_id=run_id,
        trajectory_id=trajectory_id,
        group_id=group_id,
        task_id="sample-task",
        step=step,
        screenshot_sha256=screenshot_sha256,
        url=f"http://127.0.0.1:8000/page/{step}",
        action=Action(kind="click", x=rng.randint(0, 1279), y=rng.randint(0, 719)),
        response_text="thought " * (response_tokens // 2),
        memory=memory,
        prompt_token_ids=[rng.randrange(32000) for _ in range(prompt_tokens)],
        prompt_screenshot_sha256=[screenshot_sha256],
        response_token_ids=[rng.randrange(32000) for _ in range(response_tokens)],
        behave_logprobs=[-rng.random() * 3 for _ in range(response_tokens)],
        token_policy_versions=[policy_version] * response_tokens,
        policy_version=policy_version,
        env_feedback=f"clicked button 'item {step}'",
        timings=StepTimings(policy_s=0.2, browser_s=0.05, wait_s=0.1),
        marks=SAMPLE_MARKS,
    )


SAMPLE_MARKS = [
    StepMark(id=0, role="link", name="awrl-shop.local", x=24, y=16, width=120, height=20),
    StepMark(id=1, role="button", name="Add to cart", x=1000, y=640, width=200, height=50),
]
"""The interactive elements of a `render_page` screen, as the rollout records them."""


def sample_episode(run_id: str, group_id: str, trajectory_id: str, steps: int, screenshot_sha256: str) -> list:
    """One successful episode's events, in the order a rollout pool sends them: started, steps, finished."""
    ids = dict(run_id=run_id, trajectory_id=trajectory_id, group_id=group_id, task_id="sample-task")
    return [
        EpisodeStarted(**ids, worker_id="sample", instruction="Click", horizon=10, policy_version=0),
        *(sample_step(run_id, group_id, trajectory_id, s, screenshot_sha256, seed=s) for s in range(steps)),
        EpisodeFinished(**ids, outcome="success", reward=1.0, num_steps=steps, reason="judge"),
    ]


def sample_group(
    run_id: str, group_id: str, screenshot_hashes: list[str], group_size: int = 4, steps: int = 5, seed: int = 0
):
    """Events of one finished task group, in the order a rollout pool emits them."""
    rng = random.Random(seed)
    tids, rewards, lengths = [], [], []
    for g in range(group_size):
        tid = f"{group_id}-t{g}"
        n = rng.randint(1, steps)
        reward = float(rng.random() < 0.5)
        tids.append(tid), rewards.append(reward), lengths.append(n)
        yield EpisodeStarted(
            run_id=run_id,
            trajectory_id=tid,
            group_id=group_id,
            task_id="sample-task",
            worker_id="sample",
            instruction="Add the cheapest item to the cart",
            horizon=10,
            policy_version=0,
        )
        for s in range(n):
            sha = screenshot_hashes[(g + s) % len(screenshot_hashes)]
            yield sample_step(run_id, group_id, tid, s, sha, seed=rng.randrange(1 << 30))
        yield EpisodeFinished(
            run_id=run_id,
            trajectory_id=tid,
            group_id=group_id,
            task_id="sample-task",
            outcome="success" if reward else "failure",
            reward=reward,
            num_steps=n,
            reason="judge",
        )
    yield GroupCompleted(
        run_id=run_id,
        group_id=group_id,
        task_id="sample-task",
        trajectory_ids=tids,
        rewards=rewards,
        num_steps=lengths,
        outcomes=["success" if r else "failure" for r in rewards],
        min_policy_version=0,
        max_policy_version=0,
    )


def stored_sha256(settings, version) -> str:
    """The weights' hash of a published version's checkpoint as the object store holds it."""
    from safetensors.torch import load_file

    from pipeline.checkpoints import CheckpointStore
    from pipeline.hashing import weights_sha256

    directory = CheckpointStore.from_settings(settings).download(version.checkpoint_uri)
    return weights_sha256(load_file(directory / "model.safetensors"))


MISMATCH = {
    "mismatch_tokens": 40.0,
    "mismatch_nonfinite": 0.025,
    "mismatch_k1": 0.0011,
    "mismatch_k2": 0.0012,
    "mismatch_k3": 0.0013,
    "mismatch_ratio_min": 0.8,
    "mismatch_ratio_max": 1.5,
    "mismatch_ratio_tail": 0.0,
    "mismatch_stale_tokens": 0.0,
    "mismatch_stale_k3": 0.0,
}
"""The viewable run's sampler-vs-trainer statistics (`trainer.mismatch`): fresh tokens only."""


def write_viewable_run(
    settings, run_id: str, groups: int = 2, group_size: int = 4, steps: int = 5, screenshots: int = 6
) -> dict[str, list]:
    """A run a person could look at: `screenshots` rendered pages in the store, `groups` finished groups
    acting on them, two versions and one update over every group, written through `LedgerWriter` into
    `settings.ledger_uri`. Returns the events by type."""
    from pipeline.ledger import LedgerWriter
    from pipeline.store import ScreenshotStore

    store = ScreenshotStore.from_settings(settings)
    store.ensure_bucket()
    hashes = store.put_many([render_page(f"page {i}", seed=i) for i in range(screenshots)])
    events = [e for g in range(groups) for e in sample_group(run_id, f"g{g}", hashes, group_size, steps, seed=g)]
    trained = [e.trajectory_id for e in events if isinstance(e, EpisodeFinished)]
    events += [
        PolicyVersionPublished(
            run_id=run_id,
            version=v,
            checkpoint_uri=f"s3://awrl/ckpt/{v}",
            checkpoint_sha256="0" * 64,
            update_step=v - 1 if v else None,
        )
        for v in (0, 1)
    ]
    events.append(
        UpdateApplied(
            run_id=run_id,
            update_step=0,
            version_before=0,
            version_after=1,
            group_ids=[f"g{g}" for g in range(groups)],
            trajectory_ids=trained,
            loss=0.5,
            grad_norm=1.0,
            stats={"clip_frac": 0.1, "approx_kl": 0.01, **MISMATCH},
            config_json="{}",
            weights_sha256="1" * 64,
            duration_s=0.2,
            world_size=1,
        )
    )
    by_type: dict[str, list] = {}
    for e in events:
        by_type.setdefault(type(e).__name__, []).append(e)
    writer = LedgerWriter(settings)
    for event_type, batch in by_type.items():
        writer._write(run_id, event_type, batch)
    return by_type
