"""Model inputs and the behaviour distribution, shared by the sampler, the trainer and replay.

One function builds a prompt's inputs (each `<|image_pad|>` expanded to its merged-patch count, the
token modalities Qwen3-VL's M-RoPE needs) and one computes the tempered, masked log-softmax: the
sampler records log-probs with it, the trainer and replay teacher-force with it, so the three agree to
float rounding. Positions are computed explicitly from `get_rope_index` instead of the `rope_deltas`
the model caches on itself, which would leak between prompts.
"""

from __future__ import annotations

import functools
import io

import torch
from PIL import Image

from model.architectures import make_image_processor
from model.tokenizer import SPECIAL_TOKENS, STOP_TOKENS

IMAGE_PAD = "<|image_pad|>"


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


def mrope_positions(model, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(3, B, L) M-RoPE positions of (left-padded) inputs, and the (B,) offsets that continue each row
    for later tokens. Padding is skipped, so a row's positions are those it would have alone."""
    mask = inputs["attention_mask"]
    if "image_grid_thw" not in inputs:
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        return pos.unsqueeze(0).expand(3, -1, -1), torch.zeros(mask.shape[0], dtype=torch.long)
    pos, delta = model.model.get_rope_index(
        inputs["input_ids"], inputs["mm_token_type_ids"], inputs["image_grid_thw"], attention_mask=mask
    )
    return pos, delta.view(-1)


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
