"""`VLLMPolicy`: the `Policy` contract over vLLM's OpenAI-compatible HTTP server (GPU backend).

What it relies on in vLLM (the project pins vllm 0.33; these request fields were added around 0.10
and are documented there; not exercised here, where no GPU was available; `test_vllm_live_server`
runs against a real server when AWRL_VLLM_URL is set):
- `POST /v1/chat/completions` with the messages of `prompt.build_messages` (screenshots as base64
  data URLs). The model directory written by `tiny_vlm.save_tiny_vlm` (or any Qwen3-VL checkpoint)
  carries `prompt.CHAT_TEMPLATE`, so vLLM renders the same prompt text as the local backend (serve
  with `--chat-template-content-format openai` so image parts stay where the messages put them).
- `return_token_ids: true`: the response carries `prompt_token_ids` (after image-placeholder
  expansion) and `choices[0].token_ids` (ending with the stop token, as the local backend's do).
  Fallback for servers without it: `return_tokens_as_token_ids` makes each logprob entry's token
  read `token_id:<id>`, which gives the response ids; prompt ids then stay empty.
- `logprobs: true`: one log-prob per generated token. vLLM's default `--logprobs-mode raw_logprobs`
  reports the model's unscaled distribution; serve with `--logprobs-mode processed_logprobs` to
  get the distribution actually sampled from (temperature and the logit bias below applied), which
  is what `local.token_logprobs` computes for the trainer.
- `logit_bias` of -100 on the vision/special tokens, mirroring the local backend's suppression.

Weight refresh: vLLM has no standard "load this checkpoint" route. With `reload_path` set,
`refresh` POSTs `{"model", "version", "checkpoint_uri"}` to it (a deployment's own route, e.g. a
custom router that calls `collective_rpc("reload_weights", ...)`, or vLLM's dev-mode
`/collective_rpc`, whose JSON is passed through `reload_body`). Without it, `refresh` only records
the version: whoever publishes the checkpoint is then responsible for pushing it into vLLM (e.g.
vLLM's native weight-transfer API) before announcing the version.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable

from rollout.policy.prompt import PromptConfig, build_messages
from rollout.types import Observation, PolicyOutput


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
        timeout_s: float = 120.0,
        prompt_config: PromptConfig = PromptConfig(),
    ):
        """`suppress_token_ids`: ids to bias to -100 (see `local.suppressed_token_ids`); None: none."""
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
        self.timeout_s = timeout_s
        self.prompt_config = prompt_config
        self._requests = 0

    async def act(self, obs: Observation) -> PolicyOutput:
        body = self.request_body(obs)
        version = self.version  # the version this request was sent under
        t0 = time.perf_counter()
        reply = await asyncio.to_thread(self._post, "/v1/chat/completions", body)
        out = parse_completion(reply, version)
        out.timings["policy_s"] = time.perf_counter() - t0
        return out

    async def refresh(self, version: int, checkpoint_uri: str) -> None:
        if self.reload_path:
            body = (self.reload_body or _default_reload_body)(version, checkpoint_uri)
            await asyncio.to_thread(self._post, self.reload_path, {"model": self.model, **body})
        self.version = version

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

    def _post(self, path: str, body: dict) -> dict:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(self.base_url + path, json.dumps(body).encode(), headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
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
        {"type": "image_url", "image_url": {"url": _data_url(p["image"])}} if p["type"] == "image" else p
        for p in msg["content"]
    ]
    return {"role": msg["role"], "content": parts}


def _data_url(image: bytes) -> str:
    mime = "image/jpeg" if image[:3] == b"\xff\xd8\xff" else "image/webp" if image[8:12] == b"WEBP" else "image/png"
    return f"data:{mime};base64,{base64.b64encode(image).decode()}"


def _default_reload_body(version: int, checkpoint_uri: str) -> dict:
    return {"version": version, "checkpoint_uri": checkpoint_uri}
