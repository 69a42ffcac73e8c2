"""The policy loader for any Qwen3-VL directory: a published architecture (2B, narrowed in width only)
saved and loaded like the tiny one, and the trainer's way in (meta device, then only the local rows
read from safetensors) equal to a plain load, buffers included."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from model.architectures import ARCHITECTURES, make_policy
from model.hf_io import PolicyLoadError, load_policy, load_shards, materialize, policy_on_meta, save_policy


@pytest.fixture(scope="module")
def two_b(tmp_path_factory):
    """Qwen3-VL-2B's architecture, 16x narrower: every depth, head size and DeepStack layer kept."""
    model, tokenizer = make_policy("qwen3-vl-2b", narrow=16, seed=3)
    return model, save_policy(model, tokenizer, tmp_path_factory.mktemp("2b") / "v0")


def test_a_published_architecture_saves_and_loads_as_the_tiny_one_does(two_b):
    model, directory = two_b
    text, vision = model.config.text_config, model.config.vision_config
    assert (text.num_hidden_layers, vision.depth, text.head_dim) == (28, 24, 128)
    assert vision.deepstack_visual_indexes == [5, 11, 17] and text.hidden_size == 2048 // 16
    assert model.lm_head.weight is model.model.language_model.embed_tokens.weight  # 2B ties them
    loaded, tokenizer, processor = load_policy(directory)
    assert loaded.lm_head.weight is loaded.model.language_model.embed_tokens.weight
    expected = model.state_dict()
    assert all(torch.equal(v, expected[k]) for k, v in loaded.state_dict().items())
    assert processor.patch_size == 16
    assert tokenizer.convert_tokens_to_ids("<|image_pad|>") == model.config.image_token_id


def test_meta_build_then_local_rows_equals_a_plain_load(two_b):
    _, directory = two_b
    plain = load_policy(directory)[0]
    meta = policy_on_meta(directory)
    assert all(p.is_meta for p in meta.parameters())
    materialize(meta, "cpu")
    load_shards(meta, directory)
    expected = dict(plain.named_parameters())
    assert all(torch.equal(p, expected[n]) for n, p in meta.named_parameters())
    # the rotary frequencies, which no checkpoint holds, are computed as a plain load computes them
    buffers = dict(plain.named_buffers())
    assert all(torch.equal(b, buffers[n]) for n, b in meta.named_buffers())


def test_a_directory_missing_a_weight_names_it(two_b, tmp_path):
    model, directory = two_b
    weights = load_file(directory / "model.safetensors")
    missing = "model.language_model.layers.27.mlp.down_proj.weight"
    del weights[missing]
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in directory.iterdir():
        if f.name != "model.safetensors":
            (broken / f.name).write_bytes(f.read_bytes())
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    meta = materialize(policy_on_meta(broken), "cpu")
    with pytest.raises(PolicyLoadError, match=missing.replace(".", r"\.")):
        load_shards(meta, broken)


def test_every_architecture_is_a_valid_qwen3_vl_config():
    from model.architectures import build_config
    from model.tokenizer import train_tokenizer

    for name, arch in ARCHITECTURES.items():
        config = build_config(train_tokenizer(), arch)
        text = config.text_config
        assert sum(text.rope_parameters["mrope_section"]) * 2 == text.head_dim, name
        assert max(config.vision_config.deepstack_visual_indexes) < config.vision_config.depth, name
