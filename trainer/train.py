"""The trainer: consume version-filtered task groups, update the FSDP2-sharded policy, publish versions.

Single node, CPU, 2 processes (gloo):
    awrl train --run-id RUN --nproc 2
    # which runs: torchrun --standalone --nproc_per_node 2 -m trainer.train --config CONFIG.json

N nodes x 8 GPUs (NCCL), on every node, with NODE = 0..N-1 and HEAD the address of node 0:
    awrl train --run-id RUN --model-dir DIR --nproc 8 --nnodes N --node-rank $NODE --rdzv-endpoint $HEAD:29400
    # which runs: torchrun --nnodes N --node-rank $NODE --rdzv-backend c10d --rdzv-endpoint $HEAD:29400 \
    #     --rdzv-id RUN --nproc_per_node 8 -m trainer.train --config CONFIG.json

Rank 0 alone talks to Kafka: it builds each batch (`trainer.batch`) and broadcasts it; once the
step's version is stored it publishes `UpdateApplied` + `PolicyVersionPublished` and commits the
batch's offsets. The policy is sharded with FSDP2 (`trainer.sharding`): each rank holds
1/world_size of the weights, gradients and AdamW moments, and scores its share of the batch's steps
(`trainer.update.shard`, padded so every rank runs the same forwards and backwards). No rank ever
holds the whole model at start-up: each builds it on the meta device, shards it, and reads only its
own rows (`trainer.sharding.sharded_policy`) from the HF directory at version 0, or its DCP shards
when resuming. Each version is stored twice: every rank's shards with DCP (trainer state, for resuming)
and the gathered weights as a standard HF directory (for the pool and vLLM), committed by its manifest
(`trainer.state`); the upload runs beside the next update, and the version is announced once it is
durable (`trainer.versions`).

Crash safety: a restarted trainer resumes from the last published version (weights and optimizer
shards from its DCP state) and the committed offsets; groups named by a published update or by
`GroupDropped` are skipped, so no group is trained twice and none is lost. A batch's offsets are
committed only after its version is announced: a version lost in flight is trained again.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from model.hf_io import ensure_policy, load_image_processor, load_shards, load_tokenizer, save_policy, stored_weights
from model.inputs import suppressed_token_ids
from model.push import WeightSender
from pipeline import health
from pipeline.bus import EventProducer, create_topics
from pipeline.checkpoints import CheckpointStore
from pipeline.hashing import combined_sha256, weights_sha256
from pipeline.history import sent_events
from pipeline.s3 import patiently
from pipeline.settings import StackSettings
from pipeline.store import ScreenshotStore
from pipeline.topics import TRAINER
from schemas import GroupDropped, PolicyVersionPublished, RankMemory, UpdateApplied
from trainer.batch import BatchBuilder
from trainer.config import TrainConfig
from trainer.sft import demonstrations
from trainer.sharding import FSDPOptimizer, peak_memory, reset_peak_memory, shard_sha256, sharded_policy, state_bytes
from trainer.state import full_state_dict, load_sharded
from trainer.update import (
    Scored,
    Scorer,
    StepSample,
    anchor_stats,
    combine,
    draw_anchor,
    flatten,
    interleave,
    optimizer_step,
    response_logprobs,
    shard,
    update_stats,
)
from trainer.versions import VersionWriter

log = logging.getLogger("awrl.trainer")
TRAINER_CLIENT = "trainer"
"""The trainer's producer: its outbox is part of the past a restarted trainer resumes from."""


@dataclass
class _Trainer:
    """What every rank holds for the run; rank 0 (`leader`) also holds the broker side."""

    config: TrainConfig
    settings: StackSettings
    rank: int
    world: int
    scorer: Scorer
    reference: Scorer | None
    """The frozen version 0 (the KL penalty's pi_ref), when `config.kl_coef` > 0."""
    optimizer: FSDPOptimizer
    checkpoints: CheckpointStore
    writer: VersionWriter
    version: int
    update_step: int
    producer: EventProducer | None = None
    builder: BatchBuilder | None = None
    sender: WeightSender | None = None
    """Rank 0, with `config.push_address`: the direct weight push to a sampler."""
    unannounced: list[tuple[int, list]] = field(default_factory=list)
    """Rank 0: (version, batch) of the trained batches whose version is not yet durable."""
    demonstrations: list[StepSample] = field(default_factory=list)
    """With `config.anchor.coef` > 0: the anchor's demonstration steps, read once at start."""

    @property
    def leader(self) -> bool:
        return self.rank == 0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="TrainConfig as a JSON file")
    config = TrainConfig.model_validate_json(Path(parser.parse_args(argv).config).read_text())
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(backend="nccl" if cuda else "gloo")
    torch.manual_seed(config.seed)
    t = _start(config, StackSettings(), device)
    while config.max_updates is None or t.update_step < config.max_updates:
        t_wait = time.perf_counter()
        box = [t.builder.next_batch(t.version) if t.leader else None]
        dist.broadcast_object_list(box, src=0)
        batch = box[0]
        if batch is None:
            if t.leader:
                log.info(
                    "no batch for %ss at v%d; stopping (%s)", config.batch_timeout_s, t.version, t.builder.describe()
                )
            break
        updates = _train_batch(t, batch, time.perf_counter() - t_wait)
        t.version += 1
        _publish(t, updates)
        if t.leader:
            t.unannounced.append((t.version, batch))
            _commit(t)
            log.info(
                "v%d loss %+.4f groups %d dropped %s wait %.1fs compute %.1fs",
                t.version,
                updates[-1].loss,
                len(batch),
                dict(t.builder.stats.dropped),
                updates[0].wait_s,
                sum(u.compute_s for u in updates),
            )
    t.writer.close()
    if t.leader:
        _commit(t)
        log.info("waited %.1fs in all for versions to be stored", t.writer.waited_s)
        t.builder.close()
        t.producer.close()
        if t.sender:
            t.sender.close()
    dist.destroy_process_group()


def _start(config: TrainConfig, settings: StackSettings, device: torch.device) -> _Trainer:
    """Resume from the run's last published version (weights and optimizer shards), or start at version 0."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        # the trainer's own lines at INFO; libraries (the Kafka client) only when they warn
        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s", stream=sys.stdout)
        log.setLevel(logging.INFO)
        log.info("%d process(es) on %s; config %s", world, device, config.model_dump_json())
    checkpoints = CheckpointStore.from_settings(settings)
    resume = [_resume_state(settings, config.run_id) if rank == 0 else None]
    dist.broadcast_object_list(resume, src=0)
    latest, first, skip = resume[0]

    def weights(version: PolicyVersionPublished | None) -> Path:
        return checkpoints.download(version.checkpoint_uri) if version else ensure_policy(config.model_dir)

    # What each node reads: the resume point's HF weights only where it has no sharded state (version 0),
    # and pi_ref's for a KL penalty. One download a node, into its cache, where its other ranks find it.
    resumed = latest is not None and latest.version > 0
    needed = ([] if resumed else [latest]) + ([first] if config.kl_coef else [])
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        ensure_policy(config.model_dir)
        for version in needed:
            weights(version)
    dist.barrier()
    mesh = init_device_mesh(device.type, (world,))

    def sharded(directory: Path, load: bool = True, frozen: bool = False) -> torch.nn.Module:
        """Built on the meta device, sharded, then only this rank's rows read: no rank holds the whole model."""
        return sharded_policy(
            directory,
            mesh,
            device,
            bf16=device.type == "cuda" and config.bf16,
            activation_checkpointing=config.activation_checkpointing,
            weights=load,
            frozen=frozen,
        )

    base = ensure_policy(config.model_dir)  # the tokenizer and image processor, which no update changes
    model = sharded(weights(latest) if not resumed else base, load=not resumed)
    optimizer = FSDPOptimizer(model, lr=config.lr, weight_decay=config.weight_decay, eps=config.adam_eps)
    if resumed and not load_sharded(checkpoints, config.run_id, latest.version, model, optimizer.optimizer):
        load_shards(model, weights(latest))  # a version stored without its trainer state: weights only
    tokenizer = load_tokenizer(base)
    scorer = Scorer(
        model,
        tokenizer,
        load_image_processor(base),
        suppressed_token_ids(tokenizer),
        ScreenshotStore.from_settings(settings).cached_get(),
    )
    reference = None
    if config.kl_coef:  # pi_ref: version 0, frozen, sharded like the policy
        reference = replace(scorer, model=sharded(weights(first), frozen=True))
    t = _Trainer(
        config,
        settings,
        rank,
        world,
        scorer,
        reference,
        optimizer,
        checkpoints,
        VersionWriter(checkpoints, config.run_id),
        version=latest.version if latest else 0,
        update_step=latest.update_step + 1 if latest and latest.update_step is not None else 0,
        demonstrations=_demonstrations(config, settings, rank),
    )
    if t.leader:
        create_topics(settings)
        t.producer = EventProducer(settings, client_id=TRAINER_CLIENT)
        t.builder = BatchBuilder(settings, config, t.producer, skip=skip)
        t.sender = WeightSender(config.push_address) if config.push_address else None
    if latest is None:  # announce version 0, so the lineage starts at a stored checkpoint
        _publish(t, [])
    return t


def _demonstrations(config: TrainConfig, settings: StackSettings, rank: int) -> list[StepSample]:
    """The anchor's demonstrations (`trainer.sft.demonstrations`), read by rank 0 and sent to every rank,
    so all draw from the same list even if the ledger grows meanwhile; none with the anchor off."""
    if not config.anchor.coef:
        return []
    box = [demonstrations(settings, list(config.anchor.run_ids)) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    if not box[0]:
        raise ValueError(
            f"anchor.coef > 0 but runs {list(config.anchor.run_ids)} hold no successful demonstration "
            "steps with tokens in the ledger (is it synced?)"
        )
    if rank == 0:
        log.info("anchor: %d demonstration steps from %s", len(box[0]), list(config.anchor.run_ids))
    return box[0]


def _train_batch(t: _Trainer, batch: list, wait_s: float) -> list[UpdateApplied]:
    """The batch's optimizer steps (`ppo_epochs` passes over `minibatches`, or fewer if approx_kl passes
    `target_kl`); on rank 0, one `UpdateApplied` per step."""
    config = t.config
    minibatches = [batch[m :: config.minibatches] for m in range(config.minibatches)]
    flat = [flatten(mb) for mb in minibatches]
    mine = [shard(samples, t.rank, t.world) for samples, _ in flat]
    plan = [m for _ in range(config.ppo_epochs) for m in range(config.minibatches)]  # optimizer steps
    proximal = [response_logprobs(t.scorer, s, config.temperature) for s in mine] if len(plan) > 1 else None
    reference = [response_logprobs(t.reference, s, config.temperature) for s in mine] if t.reference else None
    device = next(t.scorer.model.parameters()).device
    updates = []
    for i, m in enumerate(plan):
        t0 = time.perf_counter()
        reset_peak_memory(device)
        anchor = draw_anchor(t.demonstrations, config, t.update_step, [t.rank], t.world)
        step = optimizer_step(
            t.scorer,
            t.optimizer,
            config,
            t.update_step,
            [mine[m]],
            flat[m][1],
            t.version,
            [proximal[m]] if proximal else None,
            [reference[m]] if reference else None,
            anchor,
        )
        time.sleep(config.slow_s)
        memory = RankMemory(
            rank=t.rank,
            **vars(state_bytes(t.scorer.model, t.optimizer.optimizer)),
            peak_bytes=peak_memory(device),
            device=device.type,
        )
        loss, stats, memories, digest = _gather_stats(
            step.scored, step.anchor_nll, memory, shard_sha256(t.scorer.model), config, t.leader
        )
        compute_s = time.perf_counter() - t0
        # pi_theta has moved away from pi_prox by this step's approx_kl: past the target, stop the batch
        stop = [t.leader and config.target_kl is not None and stats.get("approx_kl", 0.0) > config.target_kl]
        if config.target_kl is not None:  # only rank 0 has the statistics; no collective when unused
            dist.broadcast_object_list(stop, src=0)
        last = stop[0] or i == len(plan) - 1
        if t.leader:
            # threads: replay needs the same intra-op thread count to reproduce the update bit for bit
            stats.update(
                groups_dropped=float(sum(t.builder.stats.dropped.values())),
                world_size=float(t.world),
                threads=float(torch.get_num_threads()),
                lr=step.lr,
                epoch=float(i // config.minibatches),
            )
            if t.demonstrations:  # replay checks that the ledger still holds as many
                stats["anchor_demonstrations"] = float(len(t.demonstrations))
            first_wait = wait_s if i == 0 else 0.0
            updates.append(
                UpdateApplied(
                    run_id=config.run_id,
                    update_step=t.update_step,
                    version_before=t.version,
                    version_after=t.version + 1 if last else t.version,
                    group_ids=[g.group_id for g in minibatches[m]],
                    trajectory_ids=[tid for g in minibatches[m] for tid in g.completed.trajectory_ids],
                    loss=loss,
                    grad_norm=step.grad_norm,
                    stats=stats,
                    config_json=config.model_dump_json(),
                    weights_sha256=digest,
                    duration_s=first_wait + compute_s,
                    wait_s=first_wait,
                    compute_s=compute_s,
                    world_size=t.world,
                    memory=memories,
                )
            )
        t.update_step += 1
        health.beat()  # a long update polls nothing, yet the trainer is alive
        if last:
            break
    return updates


def _resume_state(
    settings: StackSettings, run_id: str
) -> tuple[PolicyVersionPublished | None, PolicyVersionPublished | None, set[str]]:
    """The run's newest and first published versions and the groups already trained or dropped, from
    everything the trainer sent (`pipeline.history`): after a broker lost its log, the log alone would
    resume from version 0 and publish its numbers again."""
    create_topics(settings)
    events = sent_events(
        settings, run_id, TRAINER, (PolicyVersionPublished, UpdateApplied, GroupDropped), client_id=TRAINER_CLIENT
    )
    published = [e for e in events if isinstance(e, PolicyVersionPublished)]
    committed_updates = {u for p in published for u in p.update_ids}
    skip = {g for e in events if isinstance(e, UpdateApplied) and e.event_id in committed_updates for g in e.group_ids}
    skip |= {e.group_id for e in events if isinstance(e, GroupDropped)}
    return (
        max(published, key=lambda e: e.version, default=None),
        min(published, key=lambda e: e.version, default=None),
        skip,
    )


def _gather_stats(
    scored: list[Scored], anchor_nll: list[float], memory: RankMemory, digest: str, config: TrainConfig, leader: bool
) -> tuple[float, dict, list[RankMemory], str]:
    """On rank 0: the batch loss and statistics over every rank's samples (and demonstration steps,
    `anchor_nll`), merged in the 1-process order (so they equal a 1-process update's), each rank's
    memory, and the weights' digest from every rank's digest of its shards (the weights stay sharded)."""
    gathered = [None] * dist.get_world_size() if leader else None
    dist.gather_object((scored, anchor_nll, memory, digest), gathered, dst=0)
    if not leader:
        return 0.0, {}, [], ""
    loss, tokens = combine(interleave([s for s, _, _, _ in gathered]))
    stats = update_stats(tokens, config) | anchor_stats(interleave([a for _, a, _, _ in gathered]))
    return loss, stats, [m for _, _, m, _ in gathered], combined_sha256([d for _, _, _, d in gathered])


def _commit(t: _Trainer) -> None:
    """Rank 0: release the batches whose version is announced, then commit what the consumer can."""
    durable = t.writer.durable
    while t.unannounced and durable is not None and t.unannounced[0][0] <= durable:
        t.builder.trained(t.unannounced.pop(0)[1])
    t.builder.commit()


def _publish(t: _Trainer, updates: list[UpdateApplied]) -> None:
    """Start storing the version (`trainer.versions`): every rank's DCP shards and rank 0's HF
    directory; rank 0 sends the events once both are stored. Every rank must call it."""
    t.writer.wait()  # the previous version first: one in flight
    t0 = time.perf_counter()
    config, version = t.config, t.version
    weights = full_state_dict(t.scorer.model)  # the only gather of the weights: once a version
    announce = None
    if t.leader:
        # written and hashed now: with one process `weights` are the live parameters
        directory = save_policy(
            t.scorer.model,
            t.scorer.tokenizer,
            Path(tempfile.mkdtemp(prefix="awrl-ckpt-")) / f"v{version}",
            image_processor=t.scorer.image_processor,
            state_dict=weights,
        )
        stored = stored_weights(t.scorer.model, weights)
        sha256 = weights_sha256(stored)
        # beside the upload: the sampler holds them until this version's event names this digest
        push_s = t.sender.push(version, sha256, stored) if t.sender else None

        def announce() -> None:
            try:
                # A full or unreachable store pauses here (and so the pool, at the staleness bound)
                # instead of killing the trainer; an upload is idempotent, so a retry starts over.
                uri = patiently(
                    lambda: t.checkpoints.upload(directory, config.run_id, version), f"storing checkpoint v{version}"
                )
            finally:
                shutil.rmtree(directory.parent, ignore_errors=True)
            published = PolicyVersionPublished(
                run_id=config.run_id,
                version=version,
                checkpoint_uri=uri,
                checkpoint_sha256=sha256,
                update_step=updates[-1].update_step if updates else None,
                parent_version=version - 1 if updates else None,
                update_ids=[u.event_id for u in updates],
                publish_s=time.perf_counter() - t0,
                push_s=push_s,
            )
            t.producer.publish_all([*updates, published])

    del weights
    sharded = bool(updates) or version > 0  # the initial version has no optimizer state (`trainer.state`)
    t.writer.store(version, t.scorer.model if sharded else None, t.optimizer.optimizer if sharded else None, announce)


if __name__ == "__main__":
    main()
