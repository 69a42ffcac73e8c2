"""A direct weight push: the trainer's rank 0 sends each version's weights straight to a sampler over
gloo, beside the durable checkpoint, so the sampler skips the object store's upload and download.

The checkpoint stays what `PolicyVersionPublished` names, and the push does not wait for it to be
announced (`trainer.versions`): a sampler uses pushed weights only for the version, and digest, of a
`PolicyVersionPublished` it has received, so it never acts with a version a crash could take back,
while the push itself overlaps the upload. Without a matching push the sampler loads the checkpoint
(`rollout.policy.local.LocalPolicy`); the pool records which it was (`PolicyVersionLoaded`).

Wire: the sender serves a `torch.distributed.TCPStore`; each receiver that connects takes a new
generation number and, with the sender, a 2-member gloo group under that generation's prefix. Per
version the sender writes a header (version, digest, names, dtypes, shapes) to the store, then
broadcasts one flat buffer per dtype. One receiver at a time (the newest); the sender never waits
for an absent or dead one (its push is skipped, the store path still delivers). On GPU, vLLM's own
weight-transfer API (NCCL) takes this place (bench/gpu_check.sh).
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger("awrl.push")
TIMEOUT = timedelta(seconds=30)
JOIN_TIMEOUT = timedelta(seconds=5)
POLL_S = 0.1
"""How often a receiver asks the sender's store for the next version (a pushed version waits at most this)."""
CLOSE_WAIT = timedelta(seconds=2)
"""How long the sender, closing, waits for its receiver to stop asking: a receiver still polling when
the store goes away prints a c10d stack trace, though it falls back to the store path all the same."""
SENDER_CLOSED = "sender/closed"
KEEP = 2
"""Pushed versions a receiver holds: the trainer pushes version v+1 while v's event may still be on
its way to the pool (v is announced once stored, v+1 is pushed as soon as it is trained)."""


def parse_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host or "127.0.0.1", int(port)


def _flat(weights: dict[str, torch.Tensor]) -> dict[torch.dtype, torch.Tensor]:
    """One contiguous buffer per dtype, in the order of `weights` (one broadcast each, not one a tensor)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in weights.values():
        by_dtype.setdefault(t.dtype, []).append(t.detach().reshape(-1))
    return {dtype: torch.cat(ts) for dtype, ts in by_dtype.items()}


class WeightSender:
    """On the trainer's rank 0: serves the store at `address` ("host:port") and pushes to whichever
    receiver connected last."""

    def __init__(self, address: str):
        host, port = parse_address(address)
        self._store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
        self._generation = self._dead = 0
        self._group: dist.ProcessGroup | None = None
        self._sent = 0

    def push(self, version: int, sha256: str, weights: dict[str, torch.Tensor]) -> float | None:
        """Send `version`'s full weights; the seconds it took, or None if no receiver took them."""
        generation = self._store.add("receivers", 0)
        if generation in (0, self._dead):  # none yet, or the last one failed and none came since
            return None
        t0 = time.perf_counter()
        try:
            if generation != self._generation:  # a (new) receiver: its own group
                if self._store.check([f"g{generation}/closed"]):
                    raise RuntimeError("the receiver closed")
                self._store.set(f"g{generation}/open", b"1")
                # a receiver that is gone (a sync schedule's pool stops after each batch) never joins:
                # find out in a few seconds, not in the group's 30 s rendezvous timeout
                self._store.wait([f"g{generation}/joining"], JOIN_TIMEOUT)
                self._generation, self._sent = generation, 0
                self._group = dist.ProcessGroupGloo(dist.PrefixStore(f"g{generation}", self._store), 0, 2, TIMEOUT)
            header = {
                "version": version,
                "sha256": sha256,
                "tensors": [[k, str(v.dtype).removeprefix("torch."), list(v.shape)] for k, v in weights.items()],
            }
            self._store.set(f"g{generation}/h{self._sent}", json.dumps(header))
            self._sent += 1
            for buffer in _flat(weights).values():
                self._group.broadcast([buffer]).wait()
        except RuntimeError as error:  # the receiver went away: the checkpoint still delivers
            log.warning("weight push of v%d failed (%s); the sampler loads it from the store", version, error)
            self._dead, self._generation, self._group = generation, 0, None
            return None
        return time.perf_counter() - t0

    def close(self) -> None:
        """Tell the receiver that no version will come this way and give it `CLOSE_WAIT` to stop
        asking, so the store goes away between two of its questions, not under one."""
        generation = self._store.add("receivers", 0)
        self._store.set(SENDER_CLOSED, b"1")
        if generation in (0, self._dead) or self._store.check([f"g{generation}/closed"]):
            return
        deadline = time.monotonic() + CLOSE_WAIT.total_seconds()
        while not self._store.check([f"g{generation}/bye"]) and time.monotonic() < deadline:
            time.sleep(POLL_S / 2)


@dataclass(frozen=True)
class Pushed:
    version: int
    sha256: str
    weights: dict[str, torch.Tensor]


class WeightReceiver:
    """In the sampler's process: connects to the sender at `address` and keeps the newest pushed
    versions in memory until `take` hands one over."""

    def __init__(self, address: str):
        host, port = parse_address(address)
        self._store = dist.TCPStore(host, port, is_master=False, timeout=TIMEOUT)
        self.generation = self._store.add("receivers", 1)
        self._pushed: dict[int, Pushed] = {}
        """The newest `KEEP` versions received and not yet taken."""
        self.received = 0
        """Versions received so far."""
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._sender_gone = False
        self._thread = threading.Thread(target=self._run, name="awrl-push-receiver", daemon=True)
        self._thread.start()

    def take(self, version: int, sha256: str | None) -> Pushed | None:
        """The pushed weights of exactly this version and digest, once (None if they did not come this
        way: a version pushed, then lost in a trainer crash and trained again, has another digest)."""
        with self._lock:
            pushed = self._pushed.get(version)
            if pushed is None or pushed.sha256 != sha256:
                return None
            for v in [v for v in self._pushed if v <= version]:  # older ones will not be asked for
                del self._pushed[v]
            return pushed

    def _wait(self, key: str) -> bool:
        # Polled with `check`, which answers at once: the store's `wait` with a timeout logs a c10d
        # warning at every timeout, which printed hundreds of lines into `make demo`'s terminal.
        while not self._closed.is_set():
            try:
                if self._store.check([key]):
                    return True
                if self._store.check([SENDER_CLOSED]):  # the trainer finished: say goodbye, then stop asking
                    self._sender_gone = True
                    self._store.set(f"g{self.generation}/bye", b"1")
                    log.info("weight push: the trainer closed it; loading versions from the store")
                    return False
            except dist.DistError:  # the trainer went away: the store path delivers from now on
                self._sender_gone = True
                log.warning("weight push: the trainer closed the connection; loading versions from the store")
                return False
            self._closed.wait(POLL_S)  # not yet: the trainer publishes when it publishes
        return False

    def _run(self) -> None:
        try:
            self._receive()
        except dist.DistError as error:  # the sender died mid-version: nothing half-received is kept
            log.warning("weight push stopped (%s); loading versions from the store", error)

    def _receive(self) -> None:
        prefix = f"g{self.generation}"
        if not self._wait(f"{prefix}/open"):
            return
        self._store.set(f"{prefix}/joining", b"1")
        group = dist.ProcessGroupGloo(dist.PrefixStore(prefix, self._store), 1, 2, TIMEOUT)
        n = 0
        while self._wait(f"{prefix}/h{n}"):
            header = json.loads(self._store.get(f"{prefix}/h{n}"))
            specs = [(k, getattr(torch, dtype), torch.Size(shape)) for k, dtype, shape in header["tensors"]]
            sizes: dict[torch.dtype, int] = {}
            for _, dtype, shape in specs:
                sizes[dtype] = sizes.get(dtype, 0) + shape.numel()
            buffers = {dtype: torch.empty(size, dtype=dtype) for dtype, size in sizes.items()}
            for buffer in buffers.values():
                group.broadcast([buffer]).wait()
            offsets, weights = dict.fromkeys(buffers, 0), {}
            for name, dtype, shape in specs:
                weights[name] = buffers[dtype][offsets[dtype] : offsets[dtype] + shape.numel()].view(shape)
                offsets[dtype] += shape.numel()
            with self._lock:
                self._pushed[header["version"]] = Pushed(header["version"], header["sha256"], weights)
                while len(self._pushed) > KEEP:
                    del self._pushed[min(self._pushed)]
            n += 1
            self.received = n

    def close(self) -> None:
        self._closed.set()
        if self._sender_gone:  # its store with it: a `set` would print a c10d stack trace
            self._thread.join(timeout=5)
            return
        with contextlib.suppress(dist.DistError):  # the trainer may be gone already
            self._store.set(f"g{self.generation}/closed", b"1")
        self._thread.join(timeout=5)
