"""The `vllm` policy against a real vLLM engine on this machine's CPU (issue: a real vLLM engine in the
local stack).

One stack for the module: Tansu, Ceph radosgw and vLLM's OpenAI server (`awrl stack up --vllm`),
serving the tiny Qwen3-VL from `make vllm-env`'s environment. Two weight sets of one architecture: v0
(the tiny VLM) and v1 (v0 perturbed), whose log-probs differ by far more than the parity tolerance,
so a server that kept serving v0 after a refresh to v1 (or stale vision features from its encoder
cache) fails the parity checks.

Log-prob parity: the server's processed log-probs of the tokens it sampled against the trainer's
scoring (`trainer.update.score`) of the same tokens at the same temperature. The tolerance and why it
holds are on `PARITY_MAX`.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import psutil
import pytest
import torch

from model.hf_io import ensure_policy, load_policy, save_policy
from model.inputs import inputs_from_ids, suppressed_token_ids
from pipeline.bus import EventProducer
from pipeline.checkpoints import CheckpointStore
from pipeline.consumer import read_log
from pipeline.ledger import LedgerWriter, read_events
from pipeline.stack.local import LocalStack
from pipeline.stack.process import pid_alive
from pipeline.stack.vllm import VLLMServerConfig, vllm_healthy
from pipeline.store import ScreenshotStore
from pipeline.topics import ROLLOUT
from rollout.dispatcher import dispatch, task_stream
from rollout.episode import EpisodeConfig
from rollout.policy.local import LocalPolicy
from rollout.pool import PoolConfig, RolloutPool
from rollout.run import make_policy
from schemas import PolicyVersionPublished, StepRecorded
from schemas.observation import Observation
from trainer.update import score

from samples import render_page

SERVER_PYTHON = VLLMServerConfig(model_dir=Path(".")).python
pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(1500),
    pytest.mark.skipif(
        not SERVER_PYTHON.exists(),
        reason=f"no vLLM environment at {SERVER_PYTHON}: `make vllm-env` (`make test` builds it and runs these tests)",
    ),
]

PARITY_MAX = 1e-3
"""Largest |log pi_vLLM - log pi_trainer| allowed on any token. Both run the same float32 weights on
the same CPU but through different kernels (vLLM's CPU attention and fused ops, PyTorch's SDPA in
transformers), so they differ by float rounding: measured up to 5e-5 here (mean 1e-5). The bound
matters through decoupled PPO's staleness weight pi_prox / pi_behave = exp(log pi_prox - log
pi_behave): an error of 1e-3 in the log moves it by 0.1%, two orders below the clip range (0.2), so
the sampler's log-probs can stand for pi_behave without a second scoring pass. bf16 on a GPU is
another matter (errors of 1e-2 and more are reported): there `bench/gpu_check.sh` measures it."""
PARITY_MEAN = 1e-4
PERTURBATION = 0.05
"""Noise added to every v0 weight to make v1: it moves log-probs by about 1, far above `PARITY_MAX`."""


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("vllm-weights")
    v0 = ensure_policy(root / "v0")
    model, tokenizer, processor = load_policy(v0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * PERTURBATION)
    return v0, save_policy(model, tokenizer, root / "v1", image_processor=processor)


@pytest.fixture(scope="module")
def served(weights, tmp_path_factory):
    t0 = time.monotonic()
    # AWRL_VLLM_EXTRA_ARGS: what a GPU server needs besides (bench/gpu_check.sh)
    extra = tuple(shlex.split(os.environ.get("AWRL_VLLM_EXTRA_ARGS", "")))
    stack = LocalStack.up(
        tmp_path_factory.mktemp("vllm-stack"),
        durable=False,
        vllm=VLLMServerConfig(model_dir=weights[0], extra_args=extra),
    )
    print(f"\nstack with vLLM up in {time.monotonic() - t0:.0f} s")
    yield stack
    stack.down()


@functools.cache
def _trainer(model_dir: Path):
    model, tokenizer, processor = load_policy(model_dir)
    return model, tokenizer, processor, suppressed_token_ids(tokenizer)


def trainer_gap(model_dir: Path, prompt_ids, response_ids, logprobs, images, temperature: float) -> torch.Tensor:
    """|sampler - trainer| log-prob per response token, the trainer scoring as it does in an update."""
    model, tokenizer, processor, suppress = _trainer(Path(model_dir))
    inputs = inputs_from_ids(tokenizer, list(prompt_ids) + list(response_ids), images, processor)
    with torch.no_grad():
        trainer_lp, _ = score(model, inputs, len(response_ids), suppress, temperature)
    return (trainer_lp - torch.tensor(logprobs, dtype=trainer_lp.dtype)).abs()


def _obs(seed: int) -> Observation:
    return Observation(
        instruction="Open the second product and add it to the cart.",
        screenshots=[render_page(f"page {seed}", seed=seed)],
        screenshot_sha256=["0" * 64],
        url="http://127.0.0.1:8000/shop",
        feedback="",
        history=[],
        memory={},
        marks=[],
        som=False,
        step=0,
        horizon=8,
    )


def _policy(stack: LocalStack, model_dir: Path, temperature: float = 1.0, checkpoints=None):
    settings = stack.settings()
    return make_policy(
        "vllm",
        {},
        model_dir=model_dir,
        vllm_url=settings.vllm_url,
        vllm_model=settings.vllm_model,
        seed=7,
        temperature=temperature,
        checkpoints=checkpoints,
    )


def _act_and_gap(pol, model_dir: Path, obs: Observation, temperature: float = 1.0):
    out = asyncio.run(pol.act(obs))
    return out, trainer_gap(
        model_dir, out.prompt_token_ids, out.response_token_ids, out.logprobs, obs.screenshots, temperature
    )


def test_the_stack_runs_the_server_by_pid(served):
    assert served.health() == {"kafka": True, "ceph-mon": True, "ceph-osd": True, "s3": True, "vllm": True}
    (server,) = [s for s in served.services if s.name == "vllm"]
    assert server.process_group and served.vllm_url == f"http://127.0.0.1:{server.port}/v1"
    assert f"AWRL_VLLM_URL={served.vllm_url}" in (served.data_dir / "stack.env").read_text()
    status = subprocess.run(
        [sys.executable, "-m", "app.cli", "stack", "status", "--data-dir", str(served.data_dir)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert status.returncode == 0 and "vllm" in status.stdout, status.stdout + status.stderr


def test_the_model_judge_asks_the_live_server_and_records_what_it_said(served):
    """The model judge against the real vLLM server: the tiny model's answer is recorded whole, and it
    either parses as a verdict or, after the judge's attempts, is a judge_error naming why; never a
    silent success or failure."""
    from rollout.judges import JudgeInput, ModelJudge, ModelJudgeConfig

    settings = served.settings()
    config = ModelJudgeConfig(
        url=settings.vllm_url.removesuffix("/v1"), model=settings.vllm_model, attempts=2, max_tokens=32
    )
    shot = render_page("judged page", seed=3)
    got = asyncio.run(
        ModelJudge(config).judge(
            JudgeInput("Click the red box.", None, ["1. click the red box | click(mark=0) | clicked"], [shot])
        )
    )
    print(f"\nlive judge: {got}")
    assert got.response_text or got.error, got
    if got.success is None:
        assert got.attempts == 2 and got.reason.startswith("judge_error: ") and got.error, got
    else:
        assert got.attempts >= 1 and got.prompt_tokens > 0, got
    assert got.latency_s > 0


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_an_action_from_a_screenshot_has_token_ids_and_trainer_exact_logprobs(served, weights, temperature):
    v0 = weights[0]
    pol = _policy(served, v0, temperature)
    asyncio.run(pol.refresh(0, str(v0)))
    local = LocalPolicy(v0, max_new_tokens=4)
    assert pol.suppress_token_ids == _trainer(v0)[3]  # looked up in the server's vocabulary: the same ids
    gaps = []
    for seed in range(3):
        obs = _obs(seed)
        out, gap = _act_and_gap(pol, v0, obs, temperature)
        # the server rendered the prompt exactly as the local backend does (same template, same image grid)
        assert out.prompt_token_ids == asyncio.run(local.act(obs)).prompt_token_ids
        assert 0 < len(out.response_token_ids) == len(out.logprobs) <= pol.max_tokens
        assert out.token_policy_versions == [0] * len(out.response_token_ids)
        assert all(lp <= 0 for lp in out.logprobs) and not set(out.response_token_ids) & set(pol.suppress_token_ids)
        gaps.append(gap)
    gap = torch.cat(gaps)
    print(f"\nlog-prob parity at T={temperature}: {gap.numel()} tokens, max {gap.max():.2e}, mean {gap.mean():.2e}")
    assert gap.max() < PARITY_MAX and gap.mean() < PARITY_MEAN


def test_refreshes_with_repeated_images_serve_the_new_weights_and_keep_the_engine_alive(served, weights):
    v0, v1 = weights
    pol = _policy(served, v0)
    asyncio.run(pol.refresh(0, str(v0)))
    obs = _obs(seed=11)  # the same screenshot at every version: the encoder cache holds it after the first
    for version, model_dir in [(0, v0), (1, v1), (2, v0), (3, v1)]:
        if version:
            asyncio.run(pol.refresh(version, str(model_dir)))
        out, gap = _act_and_gap(pol, model_dir, obs)
        assert out.token_policy_versions[0] == version and gap.max() < PARITY_MAX, (version, gap.max())
        # the negative control: the other weights' scoring of the same tokens is far off
        other = v1 if model_dir == v0 else v0
        stale = trainer_gap(other, out.prompt_token_ids, out.response_token_ids, out.logprobs, obs.screenshots, 1.0)
        assert stale.max() > 100 * PARITY_MAX
    assert vllm_healthy(int(served.vllm_url.rsplit(":", 1)[1].split("/")[0]))
    print(f"\nrefresh (reload + cache resets): {pol.last_refresh_s * 1000:.0f} ms {pol.last_refresh_timings}")


def test_refreshes_under_load_keep_the_engine_alive_and_every_version_exact(served, weights):
    """Four workers act on two screenshots while versions land: the refresh waits for the actions in
    flight and pauses the server, so no request straddles two weight sets. Without that, vLLM's
    encoder-cache reset under running requests killed the engine (module docstring of vllm_client)."""
    v0, v1 = weights
    pol = _policy(served, v0)
    asyncio.run(pol.refresh(0, str(v0)))
    observations = [_obs(seed=20 + i % 2) for i in range(4)]
    outs = []

    async def worker(obs):
        for _ in range(4):
            outs.append((await pol.act(obs), obs))

    async def refresher():
        for k in range(1, 5):
            await asyncio.sleep(0.5)
            await pol.refresh(k, str(v1 if k % 2 else v0))

    async def scenario():
        await asyncio.gather(*(worker(o) for o in observations), refresher())

    asyncio.run(scenario())
    assert vllm_healthy(int(served.vllm_url.rsplit(":", 1)[1].split("/")[0]))
    assert len({out.token_policy_versions[0] for out, _ in outs}) >= 2
    for out, obs in outs:
        (version,) = set(out.token_policy_versions)
        gap = trainer_gap(
            v1 if version % 2 else v0, out.prompt_token_ids, out.response_token_ids, out.logprobs, obs.screenshots, 1.0
        )
        assert gap.max() < PARITY_MAX, (version, gap.max())


def test_a_failed_refresh_says_why_keeps_the_old_version_and_the_engine(served, weights, tmp_path):
    v0, v1 = weights
    pol = _policy(served, v0)
    asyncio.run(pol.refresh(1, str(v1)))
    # A path the server could not load never reaches it.
    with pytest.raises(
        RuntimeError,
        match=r"version 2 \(/no/such/checkpoint\) failed before reaching the server, "
        r"which keeps version 1",
    ):
        asyncio.run(pol.refresh(2, "/no/such/checkpoint"))
    # A checkpoint that looks whole but is not: vLLM's reload fails half-way (its weights are left on
    # the meta device); the client reloads the last good weights before raising.
    broken = tmp_path / "truncated"
    shutil.copytree(v0, broken)
    for st in broken.glob("*.safetensors"):
        st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])
    with pytest.raises(RuntimeError, match=r"failed at POST /collective_rpc: .*500.*restored to version 1"):
        asyncio.run(pol.refresh(2, str(broken)))
    assert pol.version == 1 and pol.weights_dir == str(v1)
    out, gap = _act_and_gap(pol, v1, _obs(seed=5))
    assert out.token_policy_versions[0] == 1 and gap.max() < PARITY_MAX


def test_a_refresh_mid_episode_loads_the_s3_checkpoint_through_the_pools_fetch(served, weights, sites, tmp_path):
    v0, v1 = weights
    settings = served.settings().model_copy(update={"topic_prefix": f"t{uuid.uuid4().hex[:8]}"})
    from pipeline.bus import create_topics

    create_topics(settings)
    checkpoints = CheckpointStore.from_settings(settings, cache_dir=tmp_path / "cache")
    uri = checkpoints.upload(v1, "vllm-live", 1)
    pol = _policy(served, v0, checkpoints=checkpoints)
    asyncio.run(pol.refresh(0, str(v0)))
    run_id = f"vllm-{uuid.uuid4().hex[:6]}"
    producer = EventProducer(settings)
    multi = [t for t in sites.tasks("train") if t.horizon >= 6]
    dispatch(producer, run_id, task_stream(multi, seed=3), 1, 2)
    pool = RolloutPool(
        settings,
        {"sites": sites},
        pol,
        PoolConfig(
            workers=2, run_id=run_id, consumer_group=f"rollout-{run_id}", episode=EpisodeConfig(max_invalid_streak=None)
        ),
    )

    acted, act = threading.Event(), pol.act

    async def act_and_say(obs):
        out = await act(obs)
        acted.set()
        return out

    pol.act = act_and_say

    def publish_after_first_steps():
        acted.wait(300)
        producer.publish_all(
            [PolicyVersionPublished(run_id=run_id, version=1, checkpoint_uri=uri, checkpoint_sha256="0" * 64)]
        )

    threading.Thread(target=publish_after_first_steps, daemon=True).start()
    asyncio.run(pool.run(max_groups=1))
    producer.close()
    assert pol.version == 1 and Path(pol.weights_dir).is_relative_to(tmp_path / "cache")  # fetched from S3
    steps = sorted(
        (e for e in read_log(settings, ROLLOUT) if isinstance(e, StepRecorded) and e.run_id == run_id),
        key=lambda s: (s.trajectory_id, s.step),
    )
    by_traj: dict[str, list[int]] = {}
    for s in steps:
        by_traj.setdefault(s.trajectory_id, []).extend(s.token_policy_versions)
    assert any(v[0] == 0 and v[-1] == 1 for v in by_traj.values()), by_traj  # one trajectory, two versions
    store = ScreenshotStore.from_settings(settings)
    for s in steps:  # every step's log-probs are those of the version its tokens name
        model_dir = v0 if s.token_policy_versions[0] == 0 else v1
        gap = trainer_gap(
            model_dir,
            s.prompt_token_ids,
            s.response_token_ids,
            s.behave_logprobs,
            [store.get(h) for h in s.prompt_screenshot_sha256],
            1.0,
        )
        assert len(set(s.token_policy_versions)) == 1 and gap.max() < PARITY_MAX, (s.step, s.token_policy_versions)


def _max_running(port: int, stop: threading.Event, seen: list[float]) -> None:
    """Poll vLLM's Prometheus gauge of requests in its running batch."""
    url = f"http://127.0.0.1:{port}/metrics"
    while not stop.wait(0.2):
        try:
            text = urllib.request.urlopen(url, timeout=2).read().decode()
        except OSError:
            continue
        seen += [float(v) for v in re.findall(r"^vllm:num_requests_running\{[^}]*\} ([0-9.]+)", text, re.M)]


def test_awrl_run_with_the_vllm_policy_trains_end_to_end(served, boxes_warm_start, tmp_path):
    """`awrl run --policy vllm` on the `boxes` suite from the controlled task's warm start (which
    acts validly, so groups have mixed rewards and the trainer updates): every worker's requests go
    to the one server, each published version is reloaded in place, and the whole run lands in the
    ledger."""
    settings, sft = served.settings(), boxes_warm_start
    port = int(served.vllm_url.rsplit(":", 1)[1].split("/")[0])
    stop, running = threading.Event(), []
    threading.Thread(target=_max_running, args=(port, stop, running), daemon=True).start()
    cmd = [
        sys.executable,
        "-m",
        "app.cli",
        "run",
        "--rollout.policy",
        "vllm",
        "--rollout.suite",
        "boxes",
        "--rollout.model-dir",
        str(sft),
        "--minutes",
        "15",
        "--rollout.workers",
        "4",
        "--rollout.group-size",
        "4",
        "--train.groups-per-update",
        "2",
        "--train.max-updates",
        "4",
        "--data-dir",
        str(served.data_dir),
        "--format",
        "json",
    ]  # budgeted in updates (the 4th trains only tokens of v1 on: eta 2); 15 min a cap
    # Not in the checkout: `awrl run` writes `./.env`, which `dagster dev` (run from the checkout by the
    # Dagster UI tests) loads over its own environment, pointing it at this stack after it is gone.
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, cwd=tmp_path)
    stop.set()
    print(done.stdout[-2500:])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run_id = json.loads(done.stdout.splitlines()[-1])["run_id"]
    assert max(running, default=0) >= 2, "the workers' requests never shared the server's batch"
    LedgerWriter(settings).sync(idle_exit_s=3.0)
    published = read_events(settings, run_id, "PolicyVersionPublished", ["version", "checkpoint_uri"]).to_pylist()
    assert len(read_events(settings, run_id, "UpdateApplied", ["version_after"])) >= 1 and len(published) >= 2
    versions = read_events(settings, run_id, "StepRecorded", ["policy_version"]).column("policy_version").to_pylist()
    assert max(versions) >= 1, "no step was sampled by a reloaded version"
    # a step of a reloaded version carries that version's log-probs (scored from its S3 checkpoint)
    step = next(
        e
        for e in read_log(settings, ROLLOUT)
        if isinstance(e, StepRecorded) and e.run_id == run_id and e.policy_version >= 1
    )
    uri = {p["version"]: p["checkpoint_uri"] for p in published}[step.policy_version]
    images = [ScreenshotStore.from_settings(settings).get(h) for h in step.prompt_screenshot_sha256]
    gap = trainer_gap(
        CheckpointStore.from_settings(settings, cache_dir=tmp_path / "c").download(uri),
        step.prompt_token_ids,
        step.response_token_ids,
        step.behave_logprobs,
        images,
        1.0,
    )
    assert gap.max() < PARITY_MAX
    print(
        f"\nawrl run --policy vllm: {len(published) - 1} versions, {len(versions)} steps, "
        f"max {max(running):.0f} requests in one batch"
    )


def test_down_stops_the_server_and_its_engine(served):
    (server,) = [s for s in served.services if s.name == "vllm"]
    group = [server.pid, *(c.pid for c in psutil.Process(server.pid).children(recursive=True))]
    assert len(group) >= 2  # the API server and its engine core
    served.down()
    assert not pid_alive(server) and not any(
        psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in group
    )
