"""The policy on disk: any Hugging Face Qwen3-VL directory, loaded and saved one way.

A directory holds config.json, the safetensors weights (one file or an index of several),
generation_config.json, tokenizer.json with its chat template, and preprocessor_config.json: what
`save_policy` writes, what a published Qwen3-VL checkpoint holds, and what vLLM serves.

Two ways in:
- `load_policy`: the whole model in one process (the rollout pool, SFT, replay);
- `policy_on_meta` + `materialize` + `load_shards`: the trainer's. Every rank builds the model on the
  meta device (no memory), shards it (`trainer.sharding`), allocates only its shards, then reads only
  its own rows of each weight from the safetensors files, so no rank ever holds the whole model.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, PreTrainedTokenizerFast, Qwen3VLForConditionalGeneration
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.utils import logging as hf_logging

from model.architectures import make_image_processor, make_tiny_policy
from model.tokenizer import HOME

# A pool loads every published version in place, dozens a run: a "Loading weights" bar each time is
# noise in every log. Loading is not worth a progress bar.
hf_logging.disable_progress_bar()

DEFAULT_MODEL_DIR = HOME / "models" / "tiny-vlm"
"""The tiny policy's directory, built on first use (`ensure_policy`)."""


class PolicyLoadError(ValueError):
    """A model directory that does not hold the weights its config describes."""


def load_policy(model_dir: str | Path, device: torch.device | str = "cpu"):
    """(model, tokenizer, image_processor) from an HF Qwen3-VL directory, in float32, on `device`."""
    model_dir = Path(model_dir)
    model = Qwen3VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    return model, load_tokenizer(model_dir), load_image_processor(model_dir)


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast.from_pretrained(Path(model_dir))


def load_image_processor(model_dir: str | Path) -> Qwen2VLImageProcessorPil:
    """The directory's preprocessing (patch size, merge, mean and std, pixel bounds) in the PIL
    implementation, which needs no torchvision."""
    return Qwen2VLImageProcessorPil.from_pretrained(Path(model_dir))


def save_policy(
    model,
    tokenizer,
    model_dir: str | Path,
    overwrite: bool = True,
    image_processor=None,
    state_dict: dict | None = None,
) -> Path:
    """Write a standard HF model directory (atomically: built aside, then renamed into place).
    `image_processor`: the model's own (a loaded checkpoint's); None writes the tiny model's.
    `state_dict`: the full weights to write when `model`'s own are sharded (FSDP2); a tied weight is
    written once, as for an unsharded model (gathered copies no longer share storage, by which
    transformers would otherwise recognise the tie)."""
    final = Path(model_dir)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=final.name + ".", dir=final.parent))
    try:
        model.save_pretrained(tmp, state_dict=None if state_dict is None else stored_weights(model, state_dict))
        tokenizer.save_pretrained(tmp)
        _declare_qwen2_tokenizer(tmp / "tokenizer_config.json")
        (image_processor or make_image_processor()).save_pretrained(tmp)
        _make_readable(tmp)
        if overwrite and final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def stored_weights(model, state_dict: dict) -> dict:
    """`state_dict` as `save_policy` stores it: a tied weight (the 2B and 4B LM head) once, under the
    name of the weight it shares, so its hash is the checkpoint's (`PolicyVersionPublished`)."""
    tied = model.all_tied_weights_keys
    return {k: v for k, v in state_dict.items() if k not in tied}


def ensure_policy(model_dir: str | Path | None = None, seed: int = 0) -> Path:
    """`model_dir` if it holds a model; otherwise the tiny policy, built and saved there on first use
    (default `.awrl/models/tiny-vlm`)."""
    path = Path(model_dir) if model_dir is not None else DEFAULT_MODEL_DIR
    if not (path / "config.json").exists():
        try:
            save_policy(*make_tiny_policy(seed), path, overwrite=False)
        except OSError:  # another process built it first (its rename won); theirs is as good
            if not (path / "config.json").exists():
                raise
    return path


def policy_on_meta(model_dir: str | Path) -> Qwen3VLForConditionalGeneration:
    """The directory's model on the meta device: shapes only, no memory, no weights read."""
    config = AutoConfig.from_pretrained(Path(model_dir))
    with torch.device("meta"):
        return Qwen3VLForConditionalGeneration._from_config(config, dtype=torch.float32).train()


@torch.no_grad()
def materialize(model: torch.nn.Module, device: torch.device | str) -> torch.nn.Module:
    """Allocate a meta model's (possibly sharded) storage on `device`, uninitialised, and compute the
    buffers no checkpoint holds (the rotary frequencies): the weights are `load_shards`' to fill."""
    model.to_empty(device=device)
    tied = getattr(model.config, "tie_word_embeddings", False)
    if tied and model.get_output_embeddings().weight is not model.get_input_embeddings().weight:
        model.tie_weights()  # a plain module's to_empty gives each of a shared weight's owners a copy
    for module in model.modules():
        if module._non_persistent_buffers_set:
            model._init_weights(module)  # transformers' own rule for them (RoPE inv_freq)
    return model


@torch.no_grad()
def load_shards(model: torch.nn.Module, model_dir: str | Path) -> None:
    """Copy each parameter's local rows from the directory's safetensors into `model`: under FSDP2 a
    rank reads only its dim-0 slice of every weight (memory-mapped, never the whole tensor)."""
    files = _weight_files(Path(model_dir))
    with ExitStack() as opened:  # the files' maps are closed once every row is copied out
        handles = {path: opened.enter_context(safe_open(path, framework="pt")) for path in set(files.values())}
        _copy_rows(model, model_dir, files, handles)


def _copy_rows(model: torch.nn.Module, model_dir, files: dict, handles: dict) -> None:
    """`load_shards` over open files: each parameter's local rows, its shape checked against the file's."""
    for name, param in model.named_parameters():
        if name not in files:
            raise PolicyLoadError(f"{model_dir}: no weight {name!r} in its safetensors files")
        target = param.to_local() if hasattr(param, "to_local") else param
        if target.numel() == 0:
            continue
        start = _row_offset(param, target) if target.shape != param.shape else 0
        stored = handles[files[name]].get_slice(name)
        if tuple(stored.get_shape()) != tuple(param.shape):
            raise PolicyLoadError(
                f"{model_dir}: {name} is {stored.get_shape()} on disk, {list(param.shape)} in the config"
            )
        target.copy_(stored[start : start + target.shape[0]].to(target.dtype))


def _row_offset(param, local: torch.Tensor) -> int:
    """The first global row of this rank's slice: FSDP2 lays a parameter out as `torch.chunk` on dim 0."""
    mesh = param.device_mesh
    rows_per_rank = -(-param.shape[0] // mesh.size())
    return mesh.get_local_rank() * rows_per_rank


def _weight_files(model_dir: Path) -> dict[str, Path]:
    """Weight name -> the safetensors file holding it (one file, or an index of shards)."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        return {k: model_dir / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    single = model_dir / "model.safetensors"
    if not single.exists():
        raise PolicyLoadError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")
    with safe_open(single, framework="pt") as f:
        return {k: single for k in f.keys()}


def _make_readable(directory: Path) -> None:
    # mkdtemp (and the shard writer) create owner-only files; a vLLM container may run as another user.
    os.chmod(directory, 0o755)
    for path in directory.iterdir():
        os.chmod(path, 0o644)


def _declare_qwen2_tokenizer(config_path: Path) -> None:
    """Name the class Qwen checkpoints use, so AutoTokenizer (and vLLM, on any transformers version)
    builds a Qwen2 tokenizer; it reproduces tokenizer.json's encoding exactly (tested)."""
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "Qwen2Tokenizer"
    config_path.write_text(json.dumps(config, indent=2) + "\n")


if __name__ == "__main__":  # python -m model.hf_io [DIR]: build the tiny policy's directory
    import sys
    import time

    t0 = time.perf_counter()
    out = ensure_policy(sys.argv[1] if len(sys.argv) > 1 else None)
    print(f"{out} ready in {time.perf_counter() - t0:.1f}s")
