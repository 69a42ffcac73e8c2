"""Batched sampling: the prompts waiting in one process decoded together, one forward pass per token.

Prompts of different lengths are left-padded into one batch with an attention mask. M-RoPE positions
come from `model.inputs.mrope_positions` over each row's unpadded tokens, so a row sees the positions it would see
alone and its log-probs equal the unbatched ones to float rounding (tests/test_local_policy.py). A
row that has stopped rides along until the longest row stops: on a CPU the cost of a forward pass is
mostly per call, not per row, so that is cheaper than re-packing the cache.

Every log-prob is computed by `policy_log_softmax`, the function the trainer teacher-forces with.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicCache

from model.inputs import mrope_positions, policy_log_softmax


@dataclass(frozen=True)
class Sampling:
    """How responses are drawn from the behaviour distribution."""

    temperature: float
    """Logits are divided by it; 0 is greedy (argmax of the untempered distribution)."""
    max_new_tokens: int
    """A response that has not stopped by then is cut."""
    suppress: list[int]
    """Token ids never sampled (vision and other special tokens), -inf before the softmax."""
    stop: set[int]
    """Token ids that end a response (included in it)."""


@dataclass
class Sampled:
    """One row's response: its tokens, their behaviour log-probs, and the batch's timings."""

    tokens: list[int]
    logprobs: list[float]
    prefill_s: float
    decode_s: float
    batch_size: int


def collate(rows: Sequence[dict[str, torch.Tensor]], pad_id: int) -> dict[str, torch.Tensor]:
    """Left-pad single-prompt inputs (`model.inputs.build_inputs`) into one batch; images in row order."""
    width = max(r["input_ids"].shape[1] for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    modality = torch.zeros((len(rows), width), dtype=torch.int)
    for b, r in enumerate(rows):
        n = r["input_ids"].shape[1]
        ids[b, width - n :], mask[b, width - n :] = r["input_ids"][0], 1
        modality[b, width - n :] = r["mm_token_type_ids"][0]
    batch = {"input_ids": ids, "attention_mask": mask, "mm_token_type_ids": modality}
    with_images = [r for r in rows if "pixel_values" in r]
    if with_images:
        batch["pixel_values"] = torch.cat([r["pixel_values"] for r in with_images])
        batch["image_grid_thw"] = torch.cat([r["image_grid_thw"] for r in with_images])
    return batch


@torch.no_grad()
def sample_batch(
    model,
    rows: Sequence[dict[str, torch.Tensor]],
    sampling: Sampling,
    pad_id: int,
    generator: torch.Generator | None = None,
) -> list[Sampled]:
    """Sample one response for each prompt in `rows`, all in one batch."""
    t0 = time.perf_counter()
    batch = collate(rows, pad_id)
    pos, delta = mrope_positions(model, batch)
    cache = DynamicCache(config=model.config.text_config)
    out = model(**batch, position_ids=pos, past_key_values=cache, use_cache=True, logits_to_keep=1)
    prefill_s = time.perf_counter() - t0
    mask, lengths = batch["attention_mask"], batch["attention_mask"].sum(-1)
    n = len(rows)
    tokens: list[list[int]] = [[] for _ in range(n)]
    logprobs: list[list[float]] = [[] for _ in range(n)]
    live = [True] * n
    for step in range(sampling.max_new_tokens):
        logp = policy_log_softmax(out.logits[:, -1], sampling.suppress, sampling.temperature)  # (B, V)
        if sampling.temperature > 0:
            picks = torch.multinomial(logp.exp(), 1, generator=generator).view(-1)
        else:
            picks = logp.argmax(-1)
        chosen = logp.gather(-1, picks.view(-1, 1)).view(-1)
        for b in range(n):
            if live[b]:
                token = int(picks[b])
                tokens[b].append(token)
                logprobs[b].append(float(chosen[b]))
                live[b] = token not in sampling.stop and len(tokens[b]) < sampling.max_new_tokens
        if not any(live):
            break
        mask = torch.cat([mask, torch.ones((n, 1), dtype=mask.dtype)], dim=-1)
        p = (lengths + step + delta).view(1, n, 1).expand(3, n, 1)
        out = model(
            input_ids=picks.view(n, 1), attention_mask=mask, position_ids=p, past_key_values=cache, use_cache=True
        )
    decode_s = time.perf_counter() - t0 - prefill_s
    return [Sampled(t, lp, prefill_s, decode_s, n) for t, lp in zip(tokens, logprobs)]
