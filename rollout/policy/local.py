"""`LocalPolicy`: a transformers Qwen3-VL on CPU behind the `Policy` contract, with exact log-probs.

Sampling is our own loop over a KV cache (not `generate`) so that the log-prob recorded for each
token is computed by the very function the trainer uses for teacher forcing (`policy_log_softmax`):
logits / temperature, non-stop special tokens masked to -inf, log-softmax. The behaviour policy is
therefore that masked distribution, and `teacher_forced_logprobs` reproduces it to float rounding.
Vision special tokens must be masked: a sampled `<|image_pad|>` would make the next forward look for
image features that do not exist. The inputs and that function are the model layer's (`model.inputs`).
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlparse

import torch
from transformers import Qwen3VLForConditionalGeneration
from transformers.cache_utils import DynamicCache

from model.inputs import (
    build_inputs,
    forward_logprobs,
    inputs_from_ids,
    mrope_positions,
    policy_log_softmax,
    stop_token_ids,
    suppressed_token_ids,
)
from model.prompt import PromptConfig, render_prompt
from model.tiny_vlm import ensure_tiny_vlm, load_tiny_vlm
from schemas.observation import Observation, PolicyOutput

if TYPE_CHECKING:
    from pipeline.checkpoints import CheckpointStore


class LocalPolicy:
    """A local transformers VLM; one model shared by all workers of the process (guarded by a lock)."""

    name = "local"

    def __init__(
        self,
        model_dir: str | Path | None = None,
        version: int = 0,
        max_new_tokens: int = 128,
        temperature: float = 1.0,
        seed: int = 0,
        prompt_config: PromptConfig = PromptConfig(),
        num_threads: int | None = None,
        checkpoints: CheckpointStore | None = None,
    ):
        """`num_threads`: set torch's (process-wide) intra-op threads; 1 is steadier when browsers
        share the cores (2 OpenMP threads spin-wait badly under contention). None: leave as is.
        `checkpoints`: where `s3://` checkpoints are fetched (and verified) from; None: local ones only."""
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        path = Path(model_dir) if model_dir is not None else ensure_tiny_vlm()
        self.model, self.tokenizer, self.image_processor = load_tiny_vlm(path)
        self.version = version
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.prompt_config = prompt_config
        self._suppress = suppressed_token_ids(self.tokenizer)
        self._stop = stop_token_ids(self.tokenizer)
        self._generator = torch.Generator().manual_seed(seed)
        self.checkpoints = checkpoints
        # asyncio.to_thread runs steps on executor threads; one model, one step at a time. A refresh
        # takes the lock too, so no response ever mixes two weight versions.
        self._lock = threading.Lock()

    async def act(self, obs: Observation) -> PolicyOutput:
        text, images = render_prompt(obs, self.prompt_config)
        return await asyncio.to_thread(self.generate, text, images)

    async def refresh(self, version: int, checkpoint_uri: str) -> None:
        await asyncio.to_thread(self.load_weights, version, checkpoint_uri)

    def generate(self, text: str, images: list[bytes]) -> PolicyOutput:
        """Sample one response to a rendered prompt (blocking)."""
        t0 = time.perf_counter()
        inputs = build_inputs(self.tokenizer, text, images, self.image_processor)
        with self._lock:
            t1 = time.perf_counter()
            response, logprobs, t_prefill = self._sample(inputs)
            version = self.version
        t2 = time.perf_counter()
        timings = {"prepare_s": t1 - t0, "prefill_s": t_prefill, "decode_s": t2 - t1 - t_prefill, "policy_s": t2 - t0}
        return PolicyOutput(
            response_text=self.tokenizer.decode(response, skip_special_tokens=True),
            prompt_token_ids=inputs["input_ids"][0].tolist(),
            response_token_ids=response,
            logprobs=logprobs,
            token_policy_versions=[version] * len(response),
            timings=timings,
        )

    @torch.no_grad()
    def _sample(self, inputs: dict) -> tuple[list[int], list[float], float]:
        t0 = time.perf_counter()
        pos, delta = mrope_positions(self.model, inputs)
        cache = DynamicCache(config=self.model.config.text_config)
        out = self.model(**inputs, position_ids=pos, past_key_values=cache, use_cache=True, logits_to_keep=1)
        t_prefill = time.perf_counter() - t0
        length = inputs["input_ids"].shape[1]
        tokens: list[int] = []
        logprobs: list[float] = []
        for _ in range(self.max_new_tokens):
            token, logprob = self._pick(out.logits[0, -1])
            tokens.append(token)
            logprobs.append(logprob)
            if token in self._stop or len(tokens) == self.max_new_tokens:
                break
            step = torch.tensor([[token]])
            p = torch.full((3, 1, 1), length + len(tokens) - 1 + delta)
            out = self.model(input_ids=step, position_ids=p, past_key_values=cache, use_cache=True)
        return tokens, logprobs, t_prefill

    def _pick(self, logits: torch.Tensor) -> tuple[int, float]:
        """Sample (or argmax at temperature 0) from the masked distribution; its log-prob."""
        logp = policy_log_softmax(logits, self._suppress, self.temperature)
        if self.temperature > 0:
            token = int(torch.multinomial(logp.exp(), 1, generator=self._generator))
        else:
            token = int(logp.argmax())
        return token, float(logp[token])

    @torch.no_grad()
    def teacher_forced_logprobs(self, prompt_ids: list[int], images: list[bytes], response_ids: list[int]):
        """Log-probs (a list) of a recorded response under the current weights (one forward pass)."""
        inputs = inputs_from_ids(self.tokenizer, prompt_ids + response_ids, images, self.image_processor)
        with self._lock:
            lp = forward_logprobs(self.model, inputs, len(response_ids), self._suppress, self.temperature)
        return lp.tolist()

    def load_weights(self, version: int, checkpoint_uri: str) -> None:
        """Copy weights from an HF directory into the live model: a local one (path or file:// URI),
        or an s3:// one downloaded and verified through `checkpoints` (outside the lock: generation
        goes on meanwhile)."""
        path = self._checkpoint_path(checkpoint_uri)
        fresh = Qwen3VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
        state = fresh.state_dict()
        with self._lock:
            self.model.load_state_dict(state, strict=True)
            self.version = version

    def _checkpoint_path(self, uri: str) -> Path:
        if urlparse(uri).scheme == "s3":
            if self.checkpoints is None:
                raise ValueError(f"LocalPolicy got no CheckpointStore (`checkpoints=`) to download {uri!r}")
            return self.checkpoints.download(uri)
        return _local_path(uri)


def _local_path(uri: str) -> Path:
    parsed = urlparse(uri)
    if parsed.scheme in ("", "file"):
        path = Path(unquote(parsed.path) if parsed.scheme else uri)
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"no HF checkpoint (config.json) in {path}")
        return path
    raise ValueError(f"LocalPolicy loads local checkpoints only (download {uri!r} first)")
