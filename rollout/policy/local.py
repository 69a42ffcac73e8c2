"""`LocalPolicy`: a transformers Qwen3-VL on CPU behind the `Policy` contract, with exact log-probs.

The workers of a process share one model, and the prompts they are waiting on are decoded together
(`model.sampling`): a caller queues its prompt, and the model thread takes every queued prompt as one
batch (up to `max_batch`). A refresh runs on that thread too, so it lands between batches.

Sampling is our own loop over a KV cache (not `generate`) so that the log-prob recorded for each
token is computed by the very function the trainer uses for teacher forcing (`policy_log_softmax`):
logits / temperature, non-stop special tokens masked to -inf, log-softmax. The behaviour policy is
therefore that masked distribution, and `teacher_forced_logprobs` reproduces it to float rounding.
Vision special tokens must be masked: a sampled `<|image_pad|>` would make the next forward look for
image features that do not exist. The inputs and that function are the model layer's (`model.inputs`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlparse

import torch
from transformers import Qwen3VLForConditionalGeneration

from model.hf_io import ensure_policy, load_policy
from model.inputs import build_inputs, forward_logprobs, inputs_from_ids, stop_token_ids, suppressed_token_ids
from model.prompt import PromptConfig, render_prompt
from model.push import WeightReceiver
from model.sampling import Sampled, Sampling, sample_batch
from schemas.observation import Observation, PolicyOutput

if TYPE_CHECKING:
    from pipeline.checkpoints import CheckpointStore


class LocalPolicy:
    """A local transformers VLM; one model shared by all workers of the process (on one thread)."""

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
        max_batch: int = 64,
        push_address: str | None = None,
    ):
        """`num_threads`: set torch's (process-wide) intra-op threads; 1 is steadier when browsers
        share the cores (2 OpenMP threads spin-wait badly under contention). None: leave as is.
        `checkpoints`: where `s3://` checkpoints are fetched (and verified) from; None: local ones only.
        `max_batch`: the most prompts decoded together (1: each alone, as before batching).
        `push_address`: the trainer's weight push ("host:port", `model.push`): versions pushed there
        load from memory; None, or a version not pushed: from the checkpoint."""
        self._threads_before = torch.get_num_threads()  # `close` gives the process its count back
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        path = Path(model_dir) if model_dir is not None else ensure_policy()
        self.model, self.tokenizer, self.image_processor = load_policy(path)
        self.version = version
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.prompt_config = prompt_config
        self._suppress = suppressed_token_ids(self.tokenizer)
        self._stop = stop_token_ids(self.tokenizer)
        self._generator = torch.Generator().manual_seed(seed)
        self.checkpoints = checkpoints
        self.max_batch = max_batch
        self._pad = self.tokenizer.pad_token_id
        self._queue: list[tuple[dict, Future[tuple[Sampled, int]]]] = []  # inputs -> (response, version)
        self._queue_lock = threading.Lock()
        # Every forward pass runs on one thread, one batch at a time: a refresh queued there lands
        # between batches, so no response mixes two weight versions. One thread also keeps torch on
        # one OpenMP team; forward passes hopping between threads ran 2.5x slower on 2 cores.
        self._model_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="local-policy-model")
        # Callers wait on their own threads: every worker must be able to wait in the queue at once
        # (asyncio's default executor has cores + 4 threads, which would cap the batch).
        self._executor = ThreadPoolExecutor(max_workers=64, thread_name_prefix="local-policy")
        self._push = _receiver(push_address) if push_address else None
        self.delivered: dict[int, str] = {}
        """How each loaded version came: "push" (the trainer's direct push) or "store" (the checkpoint)."""

    def _on_model_thread(self, fn, *args):
        return self._model_thread.submit(fn, *args).result()

    @property
    def sampling(self) -> Sampling:
        return Sampling(self.temperature, self.max_new_tokens, self._suppress, self._stop)

    async def act(self, obs: Observation) -> PolicyOutput:
        text, images = render_prompt(obs, self.prompt_config)
        return await asyncio.get_running_loop().run_in_executor(self._executor, self.generate, text, images)

    async def refresh(self, version: int, checkpoint_uri: str, checkpoint_sha256: str | None = None) -> None:
        await asyncio.to_thread(self.load_weights, version, checkpoint_uri, checkpoint_sha256)

    def generate(self, text: str, images: list[bytes]) -> PolicyOutput:
        """Sample one response to a rendered prompt (blocking; decoded with whatever else is queued)."""
        t0 = time.perf_counter()
        inputs = build_inputs(self.tokenizer, text, images, self.image_processor)
        mine: Future[tuple[Sampled, int]] = Future()
        with self._queue_lock:
            self._queue.append((inputs, mine))
        t1 = time.perf_counter()
        while not mine.done():  # an earlier call's batch may have taken it
            self._on_model_thread(self._run_queued)
        out, version = mine.result()
        t2 = time.perf_counter()
        timings = {
            "prepare_s": t1 - t0,
            "prefill_s": out.prefill_s,
            "decode_s": out.decode_s,
            "queue_s": t2 - t1 - out.prefill_s - out.decode_s,
            "policy_s": t2 - t0,
            "batch_size": float(out.batch_size),
        }
        return PolicyOutput(
            response_text=self.tokenizer.decode(out.tokens, skip_special_tokens=True),
            prompt_token_ids=inputs["input_ids"][0].tolist(),
            response_token_ids=out.tokens,
            logprobs=out.logprobs,
            token_policy_versions=[version] * len(out.tokens),
            timings=timings,
        )

    def _run_queued(self) -> None:
        """Decode the oldest queued prompts as one batch (on the model thread)."""
        with self._queue_lock:
            batch, self._queue = self._queue[: self.max_batch], self._queue[self.max_batch :]
        if not batch:
            return
        try:
            results = sample_batch(
                self.model, [inputs for inputs, _ in batch], self.sampling, self._pad, generator=self._generator
            )
        except Exception as error:  # every waiter of the batch hears of it, not only the one running it
            for _, waiting in batch:
                waiting.set_exception(error)
            return
        for (_, waiting), result in zip(batch, results):
            waiting.set_result((result, self.version))

    @torch.no_grad()
    def teacher_forced_logprobs(self, prompt_ids: list[int], images: list[bytes], response_ids: list[int]):
        """Log-probs (a list) of a recorded response under the current weights (one forward pass)."""
        inputs = inputs_from_ids(self.tokenizer, prompt_ids + response_ids, images, self.image_processor)
        lp = self._on_model_thread(
            forward_logprobs, self.model, inputs, len(response_ids), self._suppress, self.temperature
        )
        return lp.tolist()

    def load_weights(self, version: int, checkpoint_uri: str, checkpoint_sha256: str | None = None) -> None:
        """Copy weights into the live model: the trainer's push of this version and digest if it came,
        else an HF directory, a local one (path or file:// URI) or an s3:// one downloaded and verified
        through `checkpoints` (while generation goes on)."""
        pushed = self._push.take(version, checkpoint_sha256) if self._push else None
        if pushed is not None:
            self._on_model_thread(self._load_state, pushed.weights, version, "push")
            return
        path = self._checkpoint_path(checkpoint_uri)
        self._on_model_thread(self._load, path, version)

    def _load(self, path: Path, version: int) -> None:
        fresh = Qwen3VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
        self._load_state(fresh.state_dict(), version, "store")

    def _load_state(self, weights: dict, version: int, delivery: str) -> None:
        # a tied weight is pushed once, as stored: strict=False lets its twin keep sharing storage
        missing, unexpected = self.model.load_state_dict(weights, strict=False)
        if unexpected or set(missing) - set(self.model.all_tied_weights_keys):
            raise ValueError(f"weights do not fit the model: missing {missing}, unexpected {unexpected}")
        self.version = version
        self.delivered[version] = delivery

    def close(self) -> None:
        """Stop listening for pushed weights and give the process back its thread count (the model
        stays usable): a pool that shared the cores with a trainer must not slow the evaluation after."""
        if self._push is not None:
            self._push.close()
        torch.set_num_threads(self._threads_before)

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


def _receiver(address: str) -> WeightReceiver | None:
    """The trainer's push, or None (versions come from the store) when no sender answers at `address`:
    a trainer that made its last update has closed it, and a pool built then still needs no push."""
    try:
        return WeightReceiver(address)
    except torch.distributed.DistNetworkError as exc:
        logging.getLogger(__name__).warning(
            "weight push: no sender at %s (%s); loading versions from the store", address, str(exc).splitlines()[0]
        )
        return None
