"""`LocalPolicy`: a transformers Qwen3-VL on CPU behind the `Policy` contract, with exact log-probs.

Sampling is our own loop over a KV cache (not `generate`) so that the log-prob recorded for each
token is computed by the very function the trainer uses for teacher forcing (`policy_log_softmax`):
logits / temperature, non-stop special tokens masked to -inf, log-softmax. The behaviour policy is
therefore that masked distribution, and `teacher_forced_logprobs` reproduces it to float rounding.
Vision special tokens must be masked: a sampled `<|image_pad|>` would make the next forward look for
image features that do not exist.

Positions (Qwen3-VL's 3-D M-RoPE) are computed explicitly from `get_rope_index` instead of relying
on the `rope_deltas` the model caches on itself, which would leak between prompts.
"""

from __future__ import annotations

import asyncio
import functools
import io
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlparse

import torch
from PIL import Image
from transformers import Qwen3VLForConditionalGeneration
from transformers.cache_utils import DynamicCache

from rollout.policy.prompt import PromptConfig, render_prompt
from rollout.policy.tiny_vlm import SPECIAL_TOKENS, STOP_TOKENS, ensure_tiny_vlm, load_tiny_vlm, make_image_processor
from rollout.types import Observation, PolicyOutput

if TYPE_CHECKING:
    from pipeline.checkpoints import CheckpointStore

IMAGE_PAD = "<|image_pad|>"


# --- inputs, shared with the trainer -----------------------------------------------------------------


@functools.cache
def _default_processor():
    return make_image_processor()


def image_inputs(images: list[bytes], image_processor=None) -> dict[str, torch.Tensor]:
    """`pixel_values` (patches x 1536) and `image_grid_thw` (images x 3) for encoded PNG/JPEG bytes."""
    if not images:
        return {}
    processor = image_processor or _default_processor()
    pils = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    out = processor(pils, return_tensors="pt")
    return {"pixel_values": out["pixel_values"].float(), "image_grid_thw": out["image_grid_thw"]}


def build_inputs(tokenizer, text: str, images: list[bytes], image_processor=None) -> dict[str, torch.Tensor]:
    """Model inputs for a rendered prompt: each `<|image_pad|>` expanded to its merged-patch count."""
    pix = image_inputs(images, image_processor)
    if text.count(IMAGE_PAD) != len(images):
        raise ValueError(f"{text.count(IMAGE_PAD)} image placeholders for {len(images)} images")
    if pix:
        merge = (image_processor or _default_processor()).merge_size ** 2
        pieces = text.split(IMAGE_PAD)
        counts = (pix["image_grid_thw"].prod(-1) // merge).tolist()
        text = pieces[0] + "".join(IMAGE_PAD * n + rest for n, rest in zip(counts, pieces[1:]))
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    return {**_text_inputs(tokenizer, ids), **pix}


def inputs_from_ids(tokenizer, token_ids: list[int], images: list[bytes], image_processor=None) -> dict:
    """Model inputs for already-expanded token ids (a recorded prompt, optionally + response)."""
    ids = torch.tensor([token_ids], dtype=torch.long)
    return {**_text_inputs(tokenizer, ids), **image_inputs(images, image_processor)}


def _text_inputs(tokenizer, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    image_id = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    # Qwen3-VL needs the modality of every token (0 text, 1 image) to lay out M-RoPE positions.
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "mm_token_type_ids": (ids == image_id).int()}


def suppressed_token_ids(tokenizer) -> list[int]:
    """Special tokens a response may never contain (everything but the stop tokens)."""
    return [tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS if t not in STOP_TOKENS]


def stop_token_ids(tokenizer) -> set[int]:
    return {tokenizer.convert_tokens_to_ids(t) for t in STOP_TOKENS}


def mrope_positions(model, inputs: dict) -> tuple[torch.Tensor, int]:
    """(3, 1, L) M-RoPE positions of a prompt and the offset that continues them for later tokens."""
    ids = inputs["input_ids"]
    if "image_grid_thw" not in inputs:
        pos = torch.arange(ids.shape[1]).view(1, 1, -1).expand(3, 1, -1)
        return pos, 0
    pos, delta = model.model.get_rope_index(ids, inputs["mm_token_type_ids"], inputs["image_grid_thw"])
    return pos, int(delta.item())


def policy_log_softmax(logits: torch.Tensor, suppress: list[int], temperature: float) -> torch.Tensor:
    """The behaviour distribution: logits / temperature (1 for greedy), suppressed tokens at -inf."""
    scaled = logits.float() / (temperature if temperature > 0 else 1.0)
    scaled[..., suppress] = float("-inf")
    return torch.log_softmax(scaled, dim=-1)


def forward_log_softmax(model, inputs: dict, n_response: int, suppress: list[int], temperature: float = 1.0):
    """Differentiable behaviour distribution (n_response x V) at each of the last `n_response` tokens."""
    pos, _ = mrope_positions(model, inputs)
    out = model(**inputs, position_ids=pos, use_cache=False, logits_to_keep=n_response + 1)
    return policy_log_softmax(out.logits[0, :-1], suppress, temperature)  # position t predicts token t + 1


def forward_logprobs(model, inputs: dict, n_response: int, suppress: list[int], temperature: float = 1.0):
    """Differentiable log-probs (a tensor) of the last `n_response` tokens of `inputs` (prompt + response)."""
    if n_response == 0:
        return torch.zeros(0)
    logp = forward_log_softmax(model, inputs, n_response, suppress, temperature)
    return logp.gather(-1, inputs["input_ids"][0, -n_response:].unsqueeze(-1)).squeeze(-1)


# --- the policy ----------------------------------------------------------------------------------


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
