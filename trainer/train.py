"""The trainer: consume version-filtered task groups, update the policy, publish versions as events.

Single node, CPU, 2 processes (gloo):
    awrl train --run-id RUN --nproc 2
    # which runs: torchrun --standalone --nproc_per_node 2 -m trainer.train --config CONFIG.json

Multi-node, GPU (NCCL), on every node:
    torchrun --nnodes 2 --node_rank $NODE --nproc_per_node 8 \
        --rdzv_backend c10d --rdzv_endpoint $HEAD:29400 -m trainer.train --config CONFIG.json

Rank 0 alone talks to Kafka: it builds each batch (`trainer.batch`), broadcasts it, and after the step
writes the checkpoint to S3 and publishes `UpdateApplied` + `PolicyVersionPublished`, then commits the
consumed offsets. Every rank scores its shard of the batch's steps; gradients are summed across ranks
by one all-reduce of a flat buffer (what DDP does, without its requirement that every rank run the same
number of forward passes), so N processes compute exactly the 1-process gradient.

Crash safety: a restarted trainer resumes from the last published version (weights from its
checkpoint, optimizer state stored beside it) and the committed offsets; groups named by a published update or by
`GroupDropped` are skipped, so no group is trained twice and none is lost.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from model.inputs import suppressed_token_ids
from model.tiny_vlm import ensure_tiny_vlm, load_tiny_vlm, save_tiny_vlm
from pipeline.bus import EventProducer, create_topics, read_log
from pipeline.checkpoints import CheckpointStore
from pipeline.hashing import weights_sha256
from pipeline.settings import StackSettings
from pipeline.store import ScreenshotStore, patiently
from pipeline.topics import TRAINER
from schemas import GroupDropped, PolicyVersionPublished, UpdateApplied
from trainer.batch import BatchBuilder
from trainer.config import TrainConfig
from trainer.update import (
    Scorer,
    all_reduce_gradients,
    flatten,
    optimizer_step,
    response_logprobs,
    shard,
    update_stats,
)

log = logging.getLogger("awrl.trainer")


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
    optimizer: torch.optim.Optimizer
    checkpoints: CheckpointStore
    version: int
    update_step: int
    producer: EventProducer | None = None
    builder: BatchBuilder | None = None

    @property
    def leader(self) -> bool:
        return self.rank == 0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="TrainConfig as a JSON file")
    config = TrainConfig.model_validate_json(Path(parser.parse_args(argv).config).read_text())
    cuda = torch.cuda.is_available()
    dist.init_process_group(backend="nccl" if cuda else "gloo")
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")
    torch.manual_seed(config.seed)
    t = _start(config, StackSettings(), device)
    while config.max_updates is None or t.update_step < config.max_updates:
        t_wait = time.perf_counter()
        box = [t.builder.next_batch(t.version) if t.leader else None]
        dist.broadcast_object_list(box, src=0)
        batch = box[0]
        if batch is None:
            if t.leader:
                log.info("no batch for %ss at v%d; stopping (%s)", config.batch_timeout_s, t.version,
                         t.builder.describe())
            break
        updates = _train_batch(t, batch, time.perf_counter() - t_wait)
        t.version += 1
        if t.leader:
            _publish(t.producer, t.checkpoints, t.scorer, t.optimizer, config, t.version, t.version - 1, updates,
                     t.update_step - 1)
            t.builder.trained(batch)
            t.builder.commit()
            log.info("v%d loss %+.4f groups %d dropped %s wait %.1fs compute %.1fs", t.version, updates[-1].loss,
                     len(batch), dict(t.builder.stats.dropped), updates[0].wait_s, sum(u.compute_s for u in updates))
    if t.leader:
        t.builder.commit()
        t.builder.close()
        t.producer.close()
    dist.destroy_process_group()


def _start(config: TrainConfig, settings: StackSettings, device: torch.device) -> _Trainer:
    """Resume from the run's last published version (weights and optimizer state), or start at version 0."""
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
        return checkpoints.download(version.checkpoint_uri) if version else ensure_tiny_vlm(config.model_dir)

    if rank == 0:  # one download into the shared cache; the other ranks then find it there
        for version in (latest, first) if config.kl_coef else (latest,):
            weights(version)
    dist.barrier()
    model_dir = weights(latest)
    model, tokenizer, image_processor = load_tiny_vlm(model_dir)
    model.to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    if latest:
        with tempfile.TemporaryDirectory() as tmp:
            state = checkpoints.get_state(config.run_id, latest.version, "optimizer.pt", Path(tmp) / "optimizer.pt")
            if state is not None:
                optimizer.load_state_dict(torch.load(state, map_location=device))
    scorer = Scorer(model, tokenizer, image_processor, suppressed_token_ids(tokenizer),
                    ScreenshotStore.from_settings(settings).get)
    reference = scorer.frozen(weights(first)) if config.kl_coef else None  # pi_ref: version 0
    t = _Trainer(config, settings, rank, world, scorer, reference, optimizer, checkpoints,
                 version=latest.version if latest else 0,
                 update_step=latest.update_step + 1 if latest and latest.update_step is not None else 0)
    if t.leader:
        create_topics(settings)
        t.producer = EventProducer(settings, client_id="trainer")
        t.builder = BatchBuilder(settings, config, t.producer, skip=skip)
        if latest is None:  # announce version 0, so the lineage starts at a stored checkpoint
            _publish(t.producer, checkpoints, scorer, optimizer, config, 0, None, [], None)
    return t


def _train_batch(t: _Trainer, batch: list, wait_s: float) -> list[UpdateApplied]:
    """The batch's optimizer steps (`ppo_epochs` passes over `minibatches`, or fewer if approx_kl passes
    `target_kl`); on rank 0, one `UpdateApplied` per step."""
    config = t.config
    minibatches = [batch[m::config.minibatches] for m in range(config.minibatches)]
    flat = [flatten(mb) for mb in minibatches]
    mine = [shard(samples, t.rank, t.world) for samples, _ in flat]
    plan = [m for _ in range(config.ppo_epochs) for m in range(config.minibatches)]  # optimizer steps
    proximal = [response_logprobs(t.scorer, s, config.temperature) for s in mine] if len(plan) > 1 else None
    reference = [response_logprobs(t.reference, s, config.temperature) for s in mine] if t.reference else None
    updates = []
    for i, m in enumerate(plan):
        t0 = time.perf_counter()
        step = optimizer_step(t.scorer, t.optimizer, config, t.update_step, [mine[m]], flat[m][1], t.version,
                              [proximal[m]] if proximal else None, lambda model: all_reduce_gradients(model, t.world),
                              [reference[m]] if reference else None)
        time.sleep(config.slow_s)
        loss, stats = _gather_stats(step.loss, step.tokens[0], config, t.leader)
        compute_s = time.perf_counter() - t0
        # pi_theta has moved away from pi_prox by this step's approx_kl: past the target, stop the batch
        stop = [t.leader and config.target_kl is not None and stats.get("approx_kl", 0.0) > config.target_kl]
        if config.target_kl is not None:  # only rank 0 has the statistics; no collective when unused
            dist.broadcast_object_list(stop, src=0)
        last = stop[0] or i == len(plan) - 1
        if t.leader:
            # threads: replay needs the same intra-op thread count to reproduce the update bit for bit
            stats.update(groups_dropped=float(sum(t.builder.stats.dropped.values())), world_size=float(t.world),
                         threads=float(torch.get_num_threads()), lr=step.lr, epoch=float(i // config.minibatches))
            first_wait = wait_s if i == 0 else 0.0
            updates.append(UpdateApplied(
                run_id=config.run_id, update_step=t.update_step, version_before=t.version,
                version_after=t.version + 1 if last else t.version,
                group_ids=[g.group_id for g in minibatches[m]],
                trajectory_ids=[tid for g in minibatches[m] for tid in g.completed.trajectory_ids],
                loss=loss, grad_norm=step.grad_norm, stats=stats, config_json=config.model_dump_json(),
                weights_sha256=weights_sha256(t.scorer.model.state_dict()), duration_s=first_wait + compute_s,
                wait_s=first_wait, compute_s=compute_s, world_size=t.world,
            ))
        t.update_step += 1
        if last:
            break
    return updates


def _resume_state(settings: StackSettings, run_id: str
                  ) -> tuple[PolicyVersionPublished | None, PolicyVersionPublished | None, set[str]]:
    """The run's newest and first published versions and the groups already trained or dropped."""
    create_topics(settings)
    events = [e for e in read_log(settings, TRAINER) if e.run_id == run_id]
    published = [e for e in events if isinstance(e, PolicyVersionPublished)]
    committed_updates = {u for p in published for u in p.update_ids}
    skip = {g for e in events if isinstance(e, UpdateApplied) and e.event_id in committed_updates for g in e.group_ids}
    skip |= {e.group_id for e in events if isinstance(e, GroupDropped)}
    return (max(published, key=lambda e: e.version, default=None),
            min(published, key=lambda e: e.version, default=None), skip)


def _gather_stats(shard_loss: float, tokens: dict, config: TrainConfig, leader: bool) -> tuple[float, dict]:
    """The batch loss (sum of shard losses) and statistics over every rank's tokens, on rank 0."""
    gathered = [None] * dist.get_world_size() if leader else None
    dist.gather_object((shard_loss, {k: v.cpu() for k, v in tokens.items()}), gathered, dst=0)
    if not leader:
        return 0.0, {}
    merged = {k: torch.cat([t[k] for _, t in gathered]) for k in tokens}
    return sum(loss for loss, _ in gathered), update_stats(merged, config)


def _publish(producer: EventProducer, checkpoints: CheckpointStore, scorer: Scorer, optimizer, config: TrainConfig,
             version: int, parent: int | None, updates: list[UpdateApplied], update_step: int | None) -> None:
    """Checkpoint to S3 (a standard HF directory plus optimizer state), then the events, acknowledged."""
    t0 = time.perf_counter()
    model = scorer.model
    with tempfile.TemporaryDirectory(prefix="awrl-ckpt-") as tmp:
        directory = save_tiny_vlm(model, scorer.tokenizer, Path(tmp) / f"v{version}",
                                  image_processor=scorer.image_processor)
        torch.save(optimizer.state_dict(), Path(tmp) / "optimizer.pt")
        # A full or unreachable store pauses the trainer here (and so the pool, at the staleness
        # bound) instead of killing it; an upload is idempotent, so a retry starts over.
        patiently(lambda: checkpoints.put_state(Path(tmp) / "optimizer.pt", config.run_id, version),
                  f"storing the optimizer state of v{version}")
        uri = patiently(lambda: checkpoints.upload(directory, config.run_id, version), f"storing checkpoint v{version}")
    weights = updates[-1].weights_sha256 if updates else weights_sha256(model.state_dict())  # hashed once
    published = PolicyVersionPublished(
        run_id=config.run_id, version=version, checkpoint_uri=uri, checkpoint_sha256=weights,
        update_step=update_step, parent_version=parent, update_ids=[u.event_id for u in updates],
        publish_s=time.perf_counter() - t0,
    )
    producer.publish_all([*updates, published])


if __name__ == "__main__":
    main()
