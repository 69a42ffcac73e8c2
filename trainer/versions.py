"""Storing each version in the background, announcing it only once it is durable.

A version is two things in the object store (`trainer.state`): every rank's DCP shards (for resuming)
and the HF directory rank 0 writes (for the pool and vLLM), whose manifest commits both. Uploading
them is the slow part at scale (16 GB of bf16 weights plus 64 GB of AdamW moments at 8B), so
`VersionWriter.store` only takes the snapshot (DCP `async_save` stages a copy of this rank's shards)
and returns: the next update runs while a thread writes and uploads.

`PolicyVersionPublished` is what the pool, a resuming trainer and replay trust, so it is sent only
after every rank's shards and the HF directory are stored: a crash before that leaves the version
unannounced, and the restarted trainer resumes from the one before it (its groups were not committed
either, see `trainer.train`). One version is in flight at a time: `store` waits for the previous one,
which bounds the staged copies to one and keeps versions announced in order.

The threads of all ranks meet in a gloo group of their own: DCP plans its writes with collectives, and
the ranks' main threads use the default group meanwhile (NCCL on GPU, where DCP's collectives could
not run at all).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

from pipeline.checkpoints import CheckpointStore
from pipeline.s3 import patiently
from trainer.state import FOLDER


class VersionWriter:
    """One per rank. `store` starts a version; `wait` blocks until the one in flight is durable."""

    def __init__(self, checkpoints: CheckpointStore, run_id: str):
        """Every rank must construct it, in the same order as any other process group."""
        self.checkpoints, self.run_id = checkpoints, run_id
        self.group = dist.new_group(backend="gloo")
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="awrl-version")
        self._inflight: tuple[int, Future] | None = None
        self.durable: int | None = None
        """The newest version this rank knows is stored (on rank 0: and announced)."""
        self.waited_s = 0.0
        """Time the main thread spent waiting for a previous version (the upload outlasted an update)."""

    def store(
        self,
        version: int,
        model: torch.nn.Module | None,
        optimizer: torch.optim.Optimizer | None,
        announce: Callable[[], None] | None,
    ) -> None:
        """Snapshot this rank's shards of `model` and `optimizer` (None: the version has no sharded
        state) and store them in the background; then, once every rank has, run `announce` (rank 0:
        upload the HF directory and send the events). Every rank must call it."""
        self.wait()
        saving, tmp = None, Path(tempfile.mkdtemp(prefix="awrl-dcp-"))
        if model is not None:
            model_state, optimizer_state = get_state_dict(model, optimizer)
            # staged now (a copy on the host): the optimizer may change the live tensors from here on
            saving = dcp.async_save(
                {"model": model_state, "optimizer": optimizer_state}, checkpoint_id=tmp, process_group=self.group
            )
        self._inflight = version, self._thread.submit(self._finish, version, saving, tmp, announce)

    def _finish(self, version: int, saving: Future | None, tmp: Path, announce: Callable[[], None] | None) -> None:
        try:
            if saving is not None:
                saving.result()
                for path in sorted(tmp.iterdir()):  # this rank's shard files (rank 0: also `.metadata`)
                    patiently(
                        lambda path=path: self.checkpoints.put_state(
                            path, self.run_id, version, f"{FOLDER}/{path.name}"
                        ),
                        f"storing trainer state {path.name} of v{version}",
                    )
            dist.barrier(group=self.group)  # every rank's shards are in the store
            if announce is not None:
                announce()
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def wait(self) -> int | None:
        """Block until the version in flight is durable (raising its error); the newest durable version."""
        if self._inflight is not None:
            version, done = self._inflight
            t0 = time.perf_counter()
            done.result()
            self.waited_s += time.perf_counter() - t0
            self._inflight, self.durable = None, version
        return self.durable

    def close(self) -> None:
        self.wait()
        self._thread.shutdown()
