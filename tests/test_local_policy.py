"""The tiny Qwen3-VL and the learned-policy backends: build, save/reload, exact log-probs, latency,
suppressed vision tokens, in-place refresh, prompt rendering; vLLM's client against a fake server
(the real engine: tests/test_vllm_live.py)."""

from __future__ import annotations

import asyncio
import functools
import io
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw
from transformers import AutoTokenizer

from model.architectures import make_tiny_policy
from model.hf_io import load_policy, save_policy
from model.inputs import build_inputs, forward_logprobs, inputs_from_ids, suppressed_token_ids
from model.prompt import CHAT_TEMPLATE, PromptConfig, build_messages, render_chat, render_prompt
from model.sampling import Sampling, sample_batch
from model.tokenizer import train_tokenizer
from rollout.policy.local import LocalPolicy
from rollout.policy.vllm_client import VLLMPolicy
from rollout.types import Policy
from schemas.observation import Mark, Observation, PastStep


@functools.cache
def _png(width: int = 1280, height: int = 720, seed: int = 0) -> bytes:
    """A page-like screenshot: coloured boxes on white (noise would be slow to encode and decode)."""
    rng = np.random.RandomState(seed)
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    for _ in range(30):
        x, y = rng.randint(0, width - 100), rng.randint(0, height - 40)
        draw.rectangle((x, y, x + rng.randint(20, 300), y + rng.randint(10, 60)), fill=tuple(rng.randint(0, 255, 3)))
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


def _obs(som: bool = True, screenshots: int = 1, history: int = 2) -> Observation:
    marks = [Mark(1, "input", "Search products", 500, 40, 300, 30), Mark(2, "button", "Go", 810, 40, 40, 30)]
    past = [PastStep(f"thought {i}", {"seen": f"page {i}"}, '{"kind": "scroll", "dx": 0, "dy": 400}', "scrolled")
            for i in range(history)]  # fmt: skip
    return Observation(
        instruction="Find the cheapest laptop and report its price.",
        screenshots=[_png(seed=i) for i in range(screenshots)],
        screenshot_sha256=["0" * 64] * screenshots, url="http://127.0.0.1:8000/shop", feedback="clicked 'Go'",
        history=past, memory={"budget": "under $500"}, marks=marks, som=som, step=len(past), horizon=10,
    )  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    t0 = time.perf_counter()
    model, tokenizer = make_tiny_policy(seed=0)
    print(f"\nbuild: {sum(p.numel() for p in model.parameters()):,} parameters, vocab {len(tokenizer)},"
          f" {time.perf_counter() - t0:.1f}s")  # fmt: skip
    return save_policy(model, tokenizer, tmp_path_factory.mktemp("tiny") / "v0")


@pytest.fixture(scope="module")
def policy(model_dir):
    return LocalPolicy(model_dir, max_new_tokens=48, seed=1)


def test_tokenizer_training_is_deterministic(tmp_path):
    t0 = time.perf_counter()
    a = train_tokenizer(cache_dir=tmp_path / "a")
    seconds = time.perf_counter() - t0
    b = train_tokenizer(cache_dir=tmp_path / "b")
    print(f"\ntokenizer: vocab {len(a)} trained in {seconds:.1f}s")
    assert a.get_vocab() == b.get_vocab() and 4000 <= len(a) <= 8192  # the time is printed, not asserted
    ids = a('{"kind": "click", "x": 412, "y": 96}<|im_end|>')["input_ids"]
    assert ids[-1] == a.convert_tokens_to_ids("<|im_end|>")


def test_save_and_reload_give_identical_outputs(model_dir):
    model, tokenizer = make_tiny_policy(seed=0)
    loaded, tokenizer2, processor = load_policy(model_dir)
    assert tokenizer2.get_vocab() == tokenizer.get_vocab()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "preprocessor_config.json"):
        assert (model_dir / name).exists()
    text, images = render_prompt(_obs())
    inputs = build_inputs(tokenizer, text, images, processor)
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, loaded(**inputs).logits)
    # What vLLM would load (tokenizer_class Qwen2Tokenizer) encodes exactly like tokenizer.json.
    auto = AutoTokenizer.from_pretrained(model_dir)
    assert type(auto).__name__ == "Qwen2Tokenizer"
    assert auto(text)["input_ids"] == tokenizer(text)["input_ids"]


def test_image_inputs_layout(policy):
    text, images = render_prompt(_obs(screenshots=2))
    inputs = build_inputs(policy.tokenizer, text, images, policy.image_processor)
    # 1280x720 -> 448x224 -> a 14x28 grid of 16-px patches -> 98 tokens after the 2x2 merge.
    assert inputs["image_grid_thw"].tolist() == [[1, 14, 28], [1, 14, 28]]
    assert inputs["pixel_values"].shape == (2 * 14 * 28, 3 * 2 * 16 * 16)
    assert int(inputs["mm_token_type_ids"].sum()) == 2 * 98


def test_logprobs_match_teacher_forcing_and_latency(policy):
    obs = _obs()
    policy.max_new_tokens = 2
    asyncio.run(policy.act(obs))  # warm-up (first-call allocations)
    policy.max_new_tokens = 48
    t0 = time.perf_counter()
    out = asyncio.run(policy.act(obs))
    seconds = time.perf_counter() - t0
    n = len(out.response_token_ids)
    prefill_ms, token_ms = out.timings["prefill_s"] * 1000, out.timings["decode_s"] / n * 1000
    print(f"\nstep: {len(out.prompt_token_ids)} prompt tokens, {n} generated, {seconds:.2f}s;"
          f" prefill {prefill_ms:.0f}ms, {token_ms:.1f}ms/token")  # fmt: skip
    assert n == len(out.logprobs) == len(out.token_policy_versions) > 0
    assert set(out.token_policy_versions) == {policy.version}
    forced = policy.teacher_forced_logprobs(out.prompt_token_ids, obs.screenshots, out.response_token_ids)
    mismatch = max(abs(a - b) for a, b in zip(forced, out.logprobs))
    print(f"max |logprob - teacher forced| = {mismatch:.2e}")
    assert mismatch < 1e-4  # the latency is printed, not asserted: a loaded machine must not fail it


PARITY_MAX, PARITY_MEAN = 1e-3, 1e-4
"""The bound the vLLM tests hold sampled log-probs to (tests/test_vllm_live.py)."""


def _rows(policy):
    """Four prompts of different lengths: no history to three steps, with and without marks, 1 or 2 images."""
    observations = [_obs(history=0), _obs(som=False, history=3), _obs(screenshots=2, history=1), _obs(history=2)]
    prompts = [render_prompt(o) for o in observations]
    rows = [build_inputs(policy.tokenizer, text, images, policy.image_processor) for text, images in prompts]
    assert len({r["input_ids"].shape[1] for r in rows}) == len(rows)
    return prompts, rows


def _assert_close(a: list[float], b: list[float]) -> None:
    gaps = [abs(x - y) for x, y in zip(a, b, strict=True)]
    assert max(gaps) < PARITY_MAX and sum(gaps) / len(gaps) < PARITY_MEAN, (max(gaps), sum(gaps) / len(gaps))


def test_a_batched_row_decodes_as_it_would_alone(policy):
    _, rows = _rows(policy)
    greedy = Sampling(0.0, 16, policy._suppress, policy._stop)
    batched = sample_batch(policy.model, rows, greedy, policy._pad)
    assert {s.batch_size for s in batched} == {len(rows)}
    for row, together in zip(rows, batched):
        alone = sample_batch(policy.model, [row], greedy, policy._pad)[0]
        assert together.tokens == alone.tokens
        _assert_close(together.logprobs, alone.logprobs)


def test_batched_logprobs_are_the_trainers_scoring(policy):
    prompts, rows = _rows(policy)
    sampled = sample_batch(
        policy.model,
        rows,
        Sampling(1.0, 24, policy._suppress, policy._stop),
        policy._pad,
        generator=torch.Generator().manual_seed(0),
    )
    for (_, images), row, s in zip(prompts, rows, sampled):
        inputs = inputs_from_ids(
            policy.tokenizer, row["input_ids"][0].tolist() + s.tokens, images, policy.image_processor
        )
        with torch.no_grad():
            forced = forward_logprobs(policy.model, inputs, len(s.tokens), policy._suppress, 1.0).tolist()
        _assert_close(s.logprobs, forced)


def test_waiting_workers_are_decoded_together_and_a_refresh_lands_between_batches(tmp_path, model_dir):
    pol = LocalPolicy(model_dir, max_new_tokens=6, seed=5)
    fresh = save_policy(*make_tiny_policy(seed=8), tmp_path / "v1")
    observations = [_obs(history=h) for h in range(6)]

    async def together():
        return await asyncio.gather(
            *[pol.act(o) for o in observations[:3]], pol.refresh(1, str(fresh)), *[pol.act(o) for o in observations[3:]]
        )

    outs = [o for o in asyncio.run(together()) if o is not None]
    assert max(o.timings["batch_size"] for o in outs) > 1, [o.timings["batch_size"] for o in outs]
    assert pol.version == 1
    scorers = {0: LocalPolicy(model_dir), 1: pol}
    for out in outs:  # each response is wholly the version it names: its log-probs are that version's
        (version,) = set(out.token_policy_versions)
        forced = scorers[version].teacher_forced_logprobs(
            out.prompt_token_ids, _obs().screenshots, out.response_token_ids
        )
        _assert_close(out.logprobs, forced)


def test_vision_tokens_never_sampled(model_dir):
    pol = LocalPolicy(model_dir, max_new_tokens=24, seed=3)
    banned = suppressed_token_ids(pol.tokenizer)
    head = pol.model.lm_head  # make the banned tokens overwhelmingly likely: suppression must still hold
    biased = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    with torch.no_grad():
        biased.weight.copy_(head.weight)
        biased.bias.zero_()
        biased.bias[banned] = 30.0
    pol.model.lm_head = biased
    obs = _obs(som=False)
    out = asyncio.run(pol.act(obs))
    assert len(out.response_token_ids) == 24 and not set(out.response_token_ids) & set(banned)
    forced = pol.teacher_forced_logprobs(out.prompt_token_ids, obs.screenshots, out.response_token_ids)
    assert max(abs(a - b) for a, b in zip(forced, out.logprobs)) < 1e-4


def test_refresh_loads_new_weights_in_place(tmp_path, model_dir):
    pol = LocalPolicy(model_dir, max_new_tokens=4)
    assert isinstance(pol, Policy)
    model, tokenizer = make_tiny_policy(seed=7)
    new_dir = save_policy(model, tokenizer, tmp_path / "v3")
    before = pol.model.lm_head.weight.clone()
    live = pol.model
    asyncio.run(pol.refresh(3, new_dir.resolve().as_uri()))
    assert pol.version == 3 and pol.model is live
    assert not torch.equal(before, pol.model.lm_head.weight)
    assert torch.equal(pol.model.lm_head.weight, model.lm_head.weight)
    assert set(asyncio.run(pol.act(_obs())).token_policy_versions) == {3}

    async def concurrently():  # workers share the model; a refresh lands between responses
        return await asyncio.gather(pol.act(_obs()), pol.refresh(4, str(new_dir)), pol.act(_obs(som=False)))

    first, _, second = asyncio.run(concurrently())
    assert len(set(first.token_policy_versions)) == 1 and len(set(second.token_policy_versions)) == 1
    assert pol.version == 4
    with pytest.raises(ValueError):
        asyncio.run(pol.refresh(5, "s3://bucket/ckpt"))


def test_prompt_content_and_marks_only_in_som():
    som_text, images = render_prompt(_obs(som=True))
    pix_text, _ = render_prompt(_obs(som=False))
    assert len(images) == 1 and som_text.count("<|image_pad|>") == 1
    assert '[1] input "Search products"' in som_text and '[1] input "Search products"' not in pix_text
    assert '"mark": 7' in som_text and '"mark"' not in pix_text
    for text in (som_text, pix_text):
        assert "Find the cheapest laptop" in text and "http://127.0.0.1:8000/shop" in text
        assert "clicked 'Go'" in text and '{"budget": "under $500"}' in text and "thought 1" in text
        assert text.endswith("<|im_start|>assistant\n")
    short = render_prompt(_obs(history=6), PromptConfig(history_steps=2))[0]
    assert "thought 5" in short and "thought 3" not in short and "budget" in short


def test_jinja_chat_template_matches_python_rendering(policy):
    messages = build_messages(_obs(screenshots=2))
    assert policy.tokenizer.chat_template == CHAT_TEMPLATE
    jinja = policy.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert jinja == render_chat(messages)


class _FakeVLLM(BaseHTTPRequestHandler):
    requests: list[tuple[str, dict]] = []
    fail: dict[str, int] = {}
    """Route (path without query) -> HTTP status to answer instead of 200."""

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _FakeVLLM.requests.append((self.path, body))
        status = _FakeVLLM.fail.get(self.path.split("?")[0], 200)
        if status != 200:
            reply = {"detail": "failed"}
        elif self.path == "/v1/chat/completions":
            logprobs = {"content": [{"token": f"token_id:{t}", "logprob": -0.5} for t in (11, 12, 2)]}
            reply = {
                "choices": [{"message": {"content": '{"action": {"kind": "stop"}}'}, "token_ids": [11, 12, 2],
                             "logprobs": logprobs}],
                "prompt_token_ids": [1, 5, 6], "usage": {"prompt_tokens": 3},
            }  # fmt: skip
        else:  # vLLM answers /collective_rpc with the workers' results, the cache resets with an empty 200
            reply = {"results": [None]} if self.path == "/collective_rpc" else None
        data = json.dumps(reply).encode() if reply is not None else b""
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture()
def fake_vllm():
    """Base URL (with /v1, as users pass it) of a fake vLLM that records every POST."""
    _FakeVLLM.requests.clear()
    _FakeVLLM.fail.clear()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeVLLM)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/v1"
    server.shutdown()
    server.server_close()


_RESETS = [("/reset_prefix_cache?reset_running_requests=true", {}), ("/reset_encoder_cache", {})]
_PAUSE, _RESUME = ("/pause?mode=wait", {}), ("/resume", {})


def test_vllm_client_against_fake_server(fake_vllm):
    pol = VLLMPolicy(fake_vllm, "tiny", version=2, suppress_token_ids=[9], reload_path="/reload")
    assert isinstance(pol, Policy)
    out = asyncio.run(pol.act(_obs()))
    assert out.response_token_ids == [11, 12, 2] and out.prompt_token_ids == [1, 5, 6]
    assert out.logprobs == [-0.5] * 3 and out.token_policy_versions == [2] * 3
    path, body = _FakeVLLM.requests[0]
    assert body["logprobs"] and body["return_token_ids"] and body["logit_bias"] == {"9": -100}
    image = body["messages"][1]["content"][1]
    assert image["type"] == "image_url" and image["image_url"]["url"].startswith("data:image/png;base64,")
    # The custom route gets the raw URI; vLLM's cache resets follow it.
    asyncio.run(pol.refresh(5, "s3://bucket/ckpt/v5"))
    assert pol.version == 5 and _FakeVLLM.requests[1:] == [
        _PAUSE,
        ("/reload", {"model": "tiny", "version": 5, "checkpoint_uri": "s3://bucket/ckpt/v5"}),
        *_RESETS,
        _RESUME,
    ]
    assert pol.last_refresh_s > 0 and set(pol.last_refresh_timings) == {
        "pause_s", "reload_s", "reset_prefix_cache_s", "reset_encoder_cache_s", "resume_s"}  # fmt: skip


def _hf_dir(root, name: str) -> str:
    """What a refresh may send the server: a directory with config.json and safetensors."""
    d = root / name
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"")
    return str(d)


def test_vllm_refresh_uses_native_reload_then_resets_caches(fake_vllm, tmp_path):
    pol = VLLMPolicy(fake_vllm, "tiny")
    v7 = _hf_dir(tmp_path, "run 1/v000007")
    asyncio.run(pol.refresh(7, "file://" + v7.replace(" ", "%20")))
    reload = (
        "/collective_rpc",
        {"method": "reload_weights", "kwargs": {"weights_path": v7, "is_checkpoint_format": True}},
    )
    # paused around it; the reload first: a reset before it would be refilled by old weights
    assert _FakeVLLM.requests == [_PAUSE, reload, *_RESETS, _RESUME]
    assert pol.version == 7 and pol.weights_dir == v7
    assert pol.last_refresh_s >= sum(pol.last_refresh_timings.values()) > 0
    # A plain path passes through; s3:// goes through `fetch`, to a directory the server can read.
    _FakeVLLM.requests.clear()
    fetched, v8 = [], _hf_dir(tmp_path, "shared/v000008")
    pol = VLLMPolicy(
        fake_vllm, "tiny", fetch=lambda uri: fetched.append(uri) or v8, cache_reset_paths=(), pause_paths=()
    )
    asyncio.run(pol.refresh(8, "s3://bucket/checkpoints/run/v000008"))
    assert fetched == ["s3://bucket/checkpoints/run/v000008"]
    assert _FakeVLLM.requests == [("/collective_rpc", {"method": "reload_weights", "kwargs": {
        "weights_path": v8, "is_checkpoint_format": True}})]  # fmt: skip


def test_vllm_refresh_errors_are_clear(fake_vllm, tmp_path):
    v3, v7 = _hf_dir(tmp_path, "v000003"), _hf_dir(tmp_path, "v000007")
    pol = VLLMPolicy(fake_vllm, "tiny", version=3, weights_dir=v3)
    # What the server could not load never reaches it (a failed reload would break the engine).
    with pytest.raises(RuntimeError, match=r"s3://bucket/checkpoints/r/v000007.*before reaching the server.*fetch="):
        asyncio.run(pol.refresh(7, "s3://bucket/checkpoints/r/v000007"))
    with pytest.raises(RuntimeError, match=r"keeps version 3: .*not an HF checkpoint directory"):
        asyncio.run(pol.refresh(7, str(tmp_path)))
    assert _FakeVLLM.requests == [] and pol.version == 3 and pol.last_refresh_s is None
    # A server without dev mode: 404 on the reload; the last good weights are tried again, the version
    # stays, the server is resumed.
    _FakeVLLM.fail["/collective_rpc"] = 404
    dev_mode = r"POST /collective_rpc: vLLM /collective_rpc answered 404.*VLLM_SERVER_DEV_MODE=1.*restoring version 3"
    with pytest.raises(RuntimeError, match=dev_mode):
        asyncio.run(pol.refresh(7, v7))
    paths = [p for p, _ in _FakeVLLM.requests]
    assert paths == [_PAUSE[0], "/collective_rpc", "/collective_rpc", _RESUME[0]] and pol.version == 3
    assert _FakeVLLM.requests[2][1]["kwargs"]["weights_path"] == v3
    # A failing cache reset fails the refresh too (stale KV would otherwise be served silently).
    _FakeVLLM.requests.clear()
    _FakeVLLM.fail.clear()
    _FakeVLLM.fail["/reset_encoder_cache"] = 500
    with pytest.raises(RuntimeError, match=r"version 7 \(.*v000007\) failed at POST /reset_encoder_cache: .*500"):
        asyncio.run(pol.refresh(7, v7))
    assert [p for p, _ in _FakeVLLM.requests] == [
        _PAUSE[0],
        "/collective_rpc",
        _RESETS[0][0],
        "/reset_encoder_cache",
        _RESUME[0],
    ]  # resumed after a failure too
    assert pol.version == 3
    # Nothing listening: the connection error is reported the same way.
    dead = VLLMPolicy("http://127.0.0.1:9/v1", "tiny", reload_timeout_s=5)
    with pytest.raises(RuntimeError, match="failed at POST /pause.*Connection refused"):
        asyncio.run(dead.refresh(1, v7))
    # A reload that fails with no earlier directory known: the message says the weights are undefined.
    _FakeVLLM.fail["/collective_rpc"] = 500
    with pytest.raises(RuntimeError, match="failed at POST /collective_rpc.*weights are now undefined"):
        asyncio.run(VLLMPolicy(fake_vllm, "tiny").refresh(1, v7))


def test_vllm_refresh_waits_for_actions_in_flight_and_holds_new_ones(fake_vllm, tmp_path):
    """No request runs across a refresh: its tokens' version is exact."""
    v1 = _hf_dir(tmp_path, "v000001")
    pol = VLLMPolicy(fake_vllm, "tiny")
    slow = threading.Event()
    post = pol._post

    def post_slowly(path, body, timeout_s=None):
        if path == "/v1/chat/completions" and not slow.is_set():
            slow.set()
            time.sleep(0.5)  # the first action is still at the server when the refresh starts
        return post(path, body, timeout_s)

    pol._post = post_slowly

    async def scenario():
        first = asyncio.create_task(pol.act(_obs()))
        while not slow.is_set():
            await asyncio.sleep(0.01)
        refresh = asyncio.create_task(pol.refresh(1, v1))
        await asyncio.sleep(0.05)
        second = asyncio.create_task(pol.act(_obs()))  # sent during the refresh: waits for it
        return await first, await refresh, await second

    first, _, second = asyncio.run(scenario())
    paths = [p for p, _ in _FakeVLLM.requests]
    assert paths == [
        "/v1/chat/completions",
        _PAUSE[0],
        "/collective_rpc",
        *[p for p, _ in _RESETS],
        _RESUME[0],
        "/v1/chat/completions",
    ]
    assert first.token_policy_versions == [0] * 3 and second.token_policy_versions == [1] * 3


def test_a_cancelled_refresh_still_completes_and_resumes_the_server(fake_vllm, tmp_path):
    """A pool stopped mid-refresh cancels it; the server must be neither left paused nor half-refreshed."""
    v1 = _hf_dir(tmp_path, "v000001")
    pol = VLLMPolicy(fake_vllm, "tiny")
    post = pol._post

    def slow_reload(path, body, timeout_s=None):
        if path == "/collective_rpc":
            time.sleep(0.3)
        return post(path, body, timeout_s)

    pol._post = slow_reload

    async def scenario():
        refresh = asyncio.create_task(pol.refresh(1, v1))
        await asyncio.sleep(0.1)
        refresh.cancel()
        with pytest.raises(asyncio.CancelledError):
            await refresh

    asyncio.run(scenario())
    while not _FakeVLLM.requests or _FakeVLLM.requests[-1] != _RESUME:  # the swap goes on in its thread
        time.sleep(0.05)
    assert [p for p, _ in _FakeVLLM.requests] == [_PAUSE[0], "/collective_rpc", *[p for p, _ in _RESETS], _RESUME[0]]
    assert pol.version == 1  # the swap completed, and says so
    assert asyncio.run(pol.act(_obs())).token_policy_versions == [1] * 3  # the gate reopened


def test_a_pushed_version_loads_from_memory_and_anything_else_from_the_checkpoint(tmp_path, model_dir, capfd):
    """The trainer's direct push (`model.push`) over a real gloo pair on 127.0.0.1: the version and
    digest the event names load from memory; a push of another digest (a version lost in a trainer
    crash and trained again) is not used; with the receiver gone the sender skips, never hangs. The
    receiver's waiting prints nothing (its store waits with a timeout printed a c10d warning a second)."""
    import socket

    from model.hf_io import stored_weights
    from model.push import WeightSender
    from pipeline.hashing import weights_sha256

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    sender = WeightSender(address)
    assert sender.push(1, "0" * 64, {}) is None  # no sampler yet: the store path only
    pol = LocalPolicy(model_dir, max_new_tokens=4, push_address=address)
    model, tokenizer = make_tiny_policy(seed=7)
    weights = stored_weights(model, model.state_dict())
    sha = weights_sha256(weights)
    assert sender.push(1, sha, weights) is not None
    deadline = time.monotonic() + 30
    while pol._push.received < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    asyncio.run(pol.refresh(1, "s3://unreachable/v1", sha))  # no store given: only the push can deliver
    assert pol.version == 1 and pol.delivered == {1: "push"}
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in pol.model.state_dict().items())

    assert sender.push(2, sha, weights) is not None  # pushed as v2 with a digest the event will not name
    while pol._push.received < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    checkpoint = save_policy(*make_tiny_policy(seed=8), tmp_path / "v2")
    asyncio.run(pol.refresh(2, str(checkpoint), "f" * 64))
    assert pol.delivered[2] == "store"
    assert torch.equal(pol.model.lm_head.weight, load_policy(checkpoint)[0].lm_head.weight)
    time.sleep(2)  # the receiver waits for a version that does not come, as between a run's updates
    pol.close()
    assert "waitForInput" not in capfd.readouterr().err


def test_a_trainer_that_closes_its_push_leaves_the_receiver_quiet(model_dir, capfd):
    """The trainer's exit: its sender says it is closing and waits for the receiver's goodbye, so the
    store goes away between two of the receiver's questions. Before, the receiver's next `check` (and
    the pool's `close`) hit a dead socket and c10d printed a C++ stack trace into the run's log."""
    import gc
    import socket

    from model.push import WeightSender

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    sender = WeightSender(address)
    pol = LocalPolicy(model_dir, max_new_tokens=4, push_address=address)
    time.sleep(0.3)  # the receiver is asking for its first version
    t0 = time.monotonic()
    sender.close()
    assert time.monotonic() - t0 < 1.5, "the receiver's goodbye did not come"
    del sender
    gc.collect()  # the store's server goes with the sender
    time.sleep(0.5)
    pol.close()
    err = capfd.readouterr().err
    assert "Exception raised from" not in err and "sendBytes failed" not in err, err[-2000:]


def test_a_pool_built_after_the_trainer_closed_its_push_loads_from_the_store(monkeypatch):
    """A sync run's new pool can start just as its trainer, done with its `max_updates`, closes the
    push: no sender answers, and the policy takes its versions from the store instead of failing."""
    import socket
    from datetime import timedelta

    import model.push
    from rollout.policy.local import _receiver

    monkeypatch.setattr(model.push, "TIMEOUT", timedelta(seconds=2))  # nothing listens: fail fast
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # a port nobody serves
    assert _receiver(f"127.0.0.1:{port}") is None


def test_a_pool_that_shared_the_cores_gives_the_process_its_threads_back(model_dir):
    """`awrl run` gives the pool's model its share of the cores; the learning loop's evaluations run in
    the same process after it, and must get every core back."""
    before = torch.get_num_threads()
    policy = LocalPolicy(model_dir, num_threads=1)
    assert torch.get_num_threads() == 1
    policy.close()
    assert torch.get_num_threads() == before
