"""Qwen3-VL architectures, and randomly initialised policies built from them (no hub downloads).

`ARCHITECTURES` holds the shapes of the Qwen3-VL family as their published `config.json` files give
them (2B, 4B, 8B: depth, widths, heads, DeepStack layers, tied embeddings) and of the tiny model the
CPU runs use. `make_policy(name, narrow=k)` builds one with every width divided by k and every depth
kept (the attention head size too, so M-RoPE's sections stay the real ones), on the tokenizer trained
here (`model.tokenizer`): a real architecture small enough for a CPU test. `make_tiny_policy` is the
tiny one, the default of every run.

The tiny model (~5M parameters: 4 text layers, 2 vision layers) uses the slow PIL
`Qwen2VLImageProcessorPil` (no torchvision needed) with Qwen3-VL's patch 16 / merge 2 / mean-std 0.5,
capped at 448x256 pixels: a 1280x720 screenshot becomes 448x224, a 28x14 patch grid and 98 image
tokens after the 2x2 merge.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3VLConfig, Qwen3VLForConditionalGeneration
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from model.tokenizer import MAX_LENGTH, SPECIAL_TOKENS, STOP_TOKENS, train_tokenizer

_QWEN3_ROPE = {
    "rope_type": "default",
    "rope_theta": 5_000_000.0,
    "mrope_section": [24, 20, 20],
    "mrope_interleaved": True,
}


@dataclass(frozen=True)
class Architecture:
    """The shape of a Qwen3-VL model; the vocabulary and special token ids come from the tokenizer."""

    text: dict
    """`text_config` fields: widths, depth, heads, head size, RoPE."""
    vision: dict
    """`vision_config` fields: widths, depth, heads, patching, DeepStack layers."""
    tie_word_embeddings: bool = False
    """The LM head shares the token embedding's weight (Qwen3-VL 2B and 4B)."""
    narrowed: tuple[str, ...] = field(
        default=("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "num_heads")
    )
    """The fields `narrow` divides (widths and head counts; never depth or head size)."""

    def narrow(self, k: int) -> Architecture:
        """Every width and head count divided by `k` (at least 1), depth and head size unchanged."""

        def scale(d: dict) -> dict:
            return {key: max(1, v // k) if key in self.narrowed else v for key, v in d.items()}

        return Architecture(scale(self.text), scale(self.vision), self.tie_word_embeddings, self.narrowed)


ARCHITECTURES: dict[str, Architecture] = {
    "tiny": Architecture(
        text=dict(hidden_size=192, intermediate_size=512, num_hidden_layers=4, num_attention_heads=3,
                  num_key_value_heads=1, head_dim=64, max_position_embeddings=MAX_LENGTH, rms_norm_eps=1e-6,
                  # mrope sections (temporal, height, width) must sum to head_dim / 2
                  rope_parameters={**_QWEN3_ROPE, "mrope_section": [16, 8, 8]}),
        vision=dict(depth=2, hidden_size=128, intermediate_size=512, num_heads=2, patch_size=16, spatial_merge_size=2,
                    temporal_patch_size=2, num_position_embeddings=1024, deepstack_visual_indexes=[0]),
    ),
    "qwen3-vl-2b": Architecture(
        text=dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, max_position_embeddings=262144, rms_norm_eps=1e-6,
                  rope_parameters=_QWEN3_ROPE),
        vision=dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, patch_size=16,
                    spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304,
                    deepstack_visual_indexes=[5, 11, 17]),
        tie_word_embeddings=True,
    ),
    "qwen3-vl-4b": Architecture(
        text=dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                  num_key_value_heads=8, head_dim=128, max_position_embeddings=262144, rms_norm_eps=1e-6,
                  rope_parameters=_QWEN3_ROPE),
        vision=dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, patch_size=16,
                    spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304,
                    deepstack_visual_indexes=[5, 11, 17]),
        tie_word_embeddings=True,
    ),
    "qwen3-vl-8b": Architecture(
        text=dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                  num_key_value_heads=8, head_dim=128, max_position_embeddings=262144, rms_norm_eps=1e-6,
                  rope_parameters=_QWEN3_ROPE),
        vision=dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, patch_size=16,
                    spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304,
                    deepstack_visual_indexes=[8, 16, 24]),
    ),
}  # fmt: skip

IMAGE_PIXELS = (32 * 32, 448 * 256)
"""(min, max) pixels after resizing; sides are multiples of patch * merge = 32."""


def build_config(
    tokenizer: PreTrainedTokenizerFast,
    architecture: Architecture = ARCHITECTURES["tiny"],
    vocab_size: int | None = None,
) -> Qwen3VLConfig:
    """The `Qwen3VLConfig` of `architecture` over `tokenizer`'s vocabulary and special tokens
    (`vocab_size`: the real one instead, e.g. 151,936 for a memory figure of a published model)."""
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    eos, pad = ids["<|im_end|>"], ids["<|endoftext|>"]
    text = dict(architecture.text, vocab_size=vocab_size or len(tokenizer), eos_token_id=eos, pad_token_id=pad)
    vision = dict(architecture.vision, out_hidden_size=architecture.text["hidden_size"])
    return Qwen3VLConfig(
        text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], eos_token_id=eos, pad_token_id=pad,
        tie_word_embeddings=architecture.tie_word_embeddings,
    )  # fmt: skip


def make_policy(
    name: str = "tiny", narrow: int = 1, seed: int = 0
) -> tuple[Qwen3VLForConditionalGeneration, PreTrainedTokenizerFast]:
    """A fresh float32 policy of the named architecture, `narrow` times narrower (weights fixed by
    `seed`), and the project's tokenizer."""
    if name not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {name!r}; known: {', '.join(ARCHITECTURES)}")
    tokenizer = train_tokenizer()
    with torch.random.fork_rng(devices=[]):  # seed the init without disturbing the caller's RNG
        torch.manual_seed(seed)
        model = Qwen3VLForConditionalGeneration(build_config(tokenizer, ARCHITECTURES[name].narrow(narrow)))
    model = model.float().eval()
    model.generation_config = GenerationConfig(
        eos_token_id=[tokenizer.convert_tokens_to_ids(t) for t in STOP_TOKENS],
        pad_token_id=tokenizer.pad_token_id,
    )
    return model, tokenizer


def make_tiny_policy(seed: int = 0) -> tuple[Qwen3VLForConditionalGeneration, PreTrainedTokenizerFast]:
    """The tiny policy every CPU run starts from (weights fixed by `seed`)."""
    return make_policy("tiny", seed=seed)


def make_image_processor() -> Qwen2VLImageProcessorPil:
    min_px, max_px = IMAGE_PIXELS
    vision = ARCHITECTURES["tiny"].vision
    return Qwen2VLImageProcessorPil(
        patch_size=vision["patch_size"], merge_size=vision["spatial_merge_size"],
        temporal_patch_size=vision["temporal_patch_size"], image_mean=[0.5] * 3, image_std=[0.5] * 3,
        size={"shortest_edge": min_px, "longest_edge": max_px},
    )  # fmt: skip
