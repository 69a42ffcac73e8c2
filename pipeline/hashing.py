"""Content hashing, in one place: screenshots, checkpoints and anything else stored by content."""

from __future__ import annotations

import hashlib


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def weights_sha256(state_dict) -> str:
    """Hash of a model's weights: names, dtypes, shapes and raw bytes, in name order.

    Independent of file format and of how the tensors are laid out in memory, so the trainer, the
    checkpoint in the object store and a replay can compare weights bit for bit.
    """
    import torch  # lazily: the rest of the pipeline does not need torch

    h = hashlib.sha256()
    for name in sorted(state_dict):
        t = state_dict[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def combined_sha256(rank_digests: list[str]) -> str:
    """One digest of sharded weights from each rank's `weights_sha256` of its own shards, in rank order.

    Nothing is gathered to compute it, so a trainer can hash every update; replay's emulated ranks
    compute the same from the same slices. One rank's digest is itself, so the weights of a 1-process
    update hash as the whole model does."""
    if len(rank_digests) == 1:
        return rank_digests[0]
    return hashlib.sha256("|".join(rank_digests).encode()).hexdigest()
