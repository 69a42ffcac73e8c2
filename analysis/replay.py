"""Replay: re-run a run's recorded updates offline, bit-exact, or through a variant of the loss.

No browser and no broker: everything comes from the ledger and the object store. For each recorded
batch (the `UpdateApplied` events sharing a `version_before`):

- the batch: the groups the updates name, assembled from the ledger's `StepRecorded` and
  `GroupCompleted` events by the trainer's own fold (`trainer.batch.GroupAssembler`);
- the start: the checkpoint of `version_before` and the trainer's sharded optimizer state stored beside
  it (DCP), read back as full tensors (`trainer.state.load_full_state`);
- the config: the recorded `config_json`, optionally with `overrides` (a variant);
- the SFT anchor's demonstrations (`TrainConfig.anchor`): read from the ledger as the trainer read
  them, each step's drawn from (seed, update step) as the trainer drew them (`trainer.update.draw_anchor`);
- the maths: the trainer's own `flatten`, `shard`, `response_logprobs` and `optimizer_step` (one
  function for both). The recorded FSDP2 world size is emulated in one process
  (`trainer.emulated_fsdp.EmulatedFSDP`): micro-batch by micro-batch, the ranks' gradients summed in rank
  order as the reduce-scatter does, the norm from the same per-rank slices, one AdamW per rank slice.

Determinism conditions (when loss, gradient norm and the weights' sha256 equal the recorded ones bit
for bit):
- a CPU run in float32 (a GPU run's bf16 kernels are not reproduced on CPU: replay then agrees to
  rounding, not bitwise);
- the same intra-op thread count as each trainer rank (recorded as `stats["threads"]`; torchrun gives
  each of several processes 1 thread), no dropout, deterministic CPU kernels;
- 1 or 2 ranks: the reduce-scatter's sum is then a single addition per element. With more ranks the
  collective's summation order is not reproduced and the last bits may differ;
- the same torch version (kernels and AdamW's arithmetic).

Each batch is replayed from its recorded start, not from the previous replayed batch: a variant's
effect is measured one update at a time on the batches the run actually saw.
"""

from __future__ import annotations

import itertools
import json
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from model.hf_io import load_policy
from model.inputs import forward_log_softmax, inputs_from_ids, suppressed_token_ids
from pipeline.checkpoints import CheckpointStore
from pipeline.hashing import weights_sha256
from pipeline.ledger import read_events
from pipeline.markdown import markdown_table
from pipeline.settings import StackSettings
from pipeline.store import ScreenshotStore
from schemas import BY_NAME, UpdateApplied, table_to_events
from trainer.batch import GroupAssembler, TrainGroup
from trainer.config import TrainConfig
from trainer.emulated_fsdp import EmulatedFSDP
from trainer.sft import demonstrations
from trainer.state import load_full_state
from trainer.update import (
    Scorer,
    StepSample,
    anchor_stats,
    combine,
    draw_anchor,
    flatten,
    optimizer_step,
    response_logprobs,
    shard,
    update_stats,
)

VARIANTS: dict[str, dict[str, object]] = {
    "per_trajectory": {"grpo.normalizer": "per_trajectory"},
    "constant": {"grpo.normalizer": "constant"},
    "1/k": {"grpo.normalizer": "constant"},
    "token": {"grpo.normalizer": "token"},
    "dr-grpo": {"grpo.normalizer": "token", "grpo.scale_by_std": False},
    "action-tokens": {"tokens.pg": "action"},
    "argument-tokens": {"tokens.pg": "arguments"},
    "action-tokens-scaffold-kl": {"tokens.pg": "action", "tokens.kl": "scaffold"},
    "raft": {"loss": "raft"},
    "tight-clip": {"ppo.eps_low": 0.1, "ppo.eps_high": 0.1},
    "no-dual-clip": {"ppo.dual_clip": 1e9},
}
"""Named variants: config overrides, in `--set` notation."""


@dataclass
class Replayed:
    """One optimizer step, replayed."""

    update_step: int
    version_before: int
    loss: float
    grad_norm: float
    weights_sha256: str
    """The digest the recorded ranks computed: each rank's slices hashed, combined in rank order."""
    stats: dict[str, float]
    full_sha256: str = ""
    """The whole model's hash, which trainers before the sharded digest recorded (at 1 rank, the same)."""

    def matches(self, recorded: UpdateApplied) -> bool:
        return (
            self.loss == recorded.loss
            and self.grad_norm == recorded.grad_norm
            and recorded.weights_sha256 in (self.weights_sha256, self.full_sha256)
        )


class RunLedger:
    """A run's recorded events, read once, and the stores its updates came from."""

    def __init__(self, settings: StackSettings, run_id: str):
        self.settings, self.run_id = settings, run_id
        self.checkpoints = CheckpointStore.from_settings(settings)
        self.fetch = ScreenshotStore.from_settings(settings).cached_get()
        self.updates: list[UpdateApplied] = sorted(self._events("UpdateApplied"), key=lambda u: u.update_step)
        self._versions = {v.version: v for v in self._events("PolicyVersionPublished")}
        self._groups = {g.group_id: g for g in self._events("GroupCompleted")}
        self._reference: torch.nn.Module | None = None
        self._demonstrations: dict[tuple[str, ...], list[StepSample]] = {}
        self._steps = defaultdict(list)
        for s in self._events("StepRecorded"):
            self._steps[s.trajectory_id].append(s)

    def _events(self, event_type: str) -> list:
        return table_to_events(read_events(self.settings, self.run_id, event_type), BY_NAME[event_type])

    def unreplayable(self) -> str | None:
        """Why this run cannot be replayed from its stores (no updates, a version's checkpoint not
        stored, the store unreachable), or None: asked before any model is loaded."""
        if not self.updates:
            return "the run recorded no updates"
        for v in sorted({u.version_before for u in self.updates} | {0}):  # 0: the KL reference
            if v not in self._versions:
                return f"version {v} was never published"
            try:
                stored = self.checkpoints.exists(self.run_id, v)
            except Exception as exc:  # noqa: BLE001 - any failure to read the store is the answer
                return f"the object store cannot be read ({type(exc).__name__})"
            if not stored:
                return f"version {v}'s checkpoint is not in the object store ({self._versions[v].checkpoint_uri})"
        return None

    def batches(self, updates: range | None = None) -> list[list[UpdateApplied]]:
        """Recorded updates grouped by batch (`version_before`), optionally only steps in `updates`."""
        by_version: dict[int, list[UpdateApplied]] = defaultdict(list)
        for u in self.updates:
            if updates is None or u.update_step in updates:
                by_version[u.version_before].append(u)
        return [by_version[v] for v in sorted(by_version)]

    def groups(self, group_ids: list[str], control: str = "none", scale_by_std: bool = True) -> list[TrainGroup]:
        """The named groups as the trainer assembled them (its own fold over the same events)."""
        out = []
        for gid in group_ids:
            completed = self._groups[gid]
            fold = GroupAssembler(self.run_id, control, scale_by_std)
            for tid in completed.trajectory_ids:
                for s in self._steps[tid]:
                    fold.add(s)
            out.append(fold.add(completed))
        return out

    def reference(self, scorer: Scorer) -> Scorer:
        """pi_ref of the KL penalty (the run's version 0) over `scorer`'s input builders, loaded once per
        ledger: it is frozen, so every replayed batch can share it."""
        if self._reference is None:
            self._reference = scorer.frozen(self.checkpoint(0)).model
        return replace(scorer, model=self._reference)

    def demonstrations(self, config: TrainConfig, recorded: UpdateApplied) -> list[StepSample]:
        """The SFT anchor's demonstration steps (`trainer.sft.demonstrations`), read once per ledger; none
        with the anchor off. Refused if the recorded config's runs now hold another number of them."""
        if not config.anchor.coef:
            return []
        key = tuple(config.anchor.run_ids)
        if key not in self._demonstrations:
            self._demonstrations[key] = demonstrations(self.settings, list(key))
        steps, count = self._demonstrations[key], recorded.stats.get("anchor_demonstrations")
        same_runs = key == TrainConfig.model_validate_json(recorded.config_json).anchor.run_ids
        if same_runs and count is not None and count != len(steps):
            raise ValueError(
                f"the anchor's runs {list(key)} hold {len(steps)} demonstration steps in the ledger, "
                f"the trainer read {count:g}: the draws would differ"
            )
        return steps

    def checkpoint(self, version: int) -> Path:
        """The local directory of a published version's weights."""
        return self.checkpoints.download(self._versions[version].checkpoint_uri)

    def start(self, version: int, config: TrainConfig, world: int):
        """(model, tokenizer, image processor, optimizer) as `world` trainer ranks held them at `version`."""
        model, tokenizer, processor = load_policy(self.checkpoint(version))
        model.train()
        optimizer = EmulatedFSDP(model, world, lr=config.lr, weight_decay=config.weight_decay, eps=config.adam_eps)
        state = load_full_state(self.checkpoints, self.run_id, version)
        if state is not None:  # the initial version has none: a fresh optimizer, as the trainer had
            optimizer.load_state(state["optimizer"]["state"])
        return model, tokenizer, processor, optimizer


BATCH_KEYS = frozenset({"eta", "dynamic_sampling", "groups_per_update", "minibatches"})
"""Settings that decide which groups form a batch: a replay keeps the recorded batches, so these are
answered by `analysis.rebatch` (`awrl rebatch`) instead."""


def with_overrides(config: TrainConfig, overrides: dict[str, object]) -> TrainConfig:
    """`config` with dotted keys replaced (`grpo.normalizer=token`), validated like any config; a key that
    changes which groups form a batch is refused (replay keeps the recorded batches)."""
    for key in overrides:
        if key in BATCH_KEYS:
            raise KeyError(
                f"{key!r} changes which groups form a batch; replay keeps the recorded batches "
                f"(use `awrl rebatch` for it)"
            )
    return set_fields(config, overrides)


def set_fields(config: TrainConfig, overrides: dict[str, object]) -> TrainConfig:
    """`config` with dotted keys replaced, any field (a new run's configuration, not a replay's)."""
    doc = json.loads(config.model_dump_json())
    for key, value in overrides.items():
        *path, leaf = key.split(".")
        node = doc
        for part in path:
            node = node[part]
        if leaf not in node:
            raise KeyError(f"no config field {key!r}")
        node[leaf] = value
    return TrainConfig.model_validate(doc)


def parse_overrides(variant: str | None, sets: list[str]) -> dict[str, object]:
    """A named variant's overrides plus `KEY=VALUE` items (JSON values, else strings), checked against
    the config before any model is loaded: what `awrl replay` and the `replay` asset both take."""
    if variant and variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; known: {', '.join(VARIANTS)}")
    overrides: dict[str, object] = (dict(VARIANTS[variant]) if variant else {}) | parse_values(sets)
    try:
        with_overrides(TrainConfig(run_id="-"), overrides)
    except (KeyError, ValueError) as exc:
        raise ValueError(" ".join(str(exc).split())) from None
    return overrides


def parse_values(items: list[str]) -> dict[str, object]:
    """`KEY=VALUE` items as a dict: JSON values, else strings."""
    out: dict[str, object] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set takes KEY=VALUE (e.g. grpo.k=5), not {item!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def update_range(text: str) -> range:
    """`A..B` (inclusive) or `A`: the update steps to replay."""
    a, sep, b = text.partition("..")
    try:
        first, last = int(a), int(b) if sep else int(a)
    except ValueError:
        raise ValueError(f"--updates takes A..B or A (update steps, e.g. 3..7), not {text!r}") from None
    if last < first:
        raise ValueError(f"--updates {text}: the range is empty")
    return range(first, last + 1)


def replay_batch(
    ledger: RunLedger, recorded: list[UpdateApplied], overrides: dict[str, object] | None = None
) -> tuple[list[Replayed], torch.nn.Module, Scorer]:
    """Replay one recorded batch from its recorded start; the replayed steps and the resulting model."""
    first = recorded[0]
    config = with_overrides(TrainConfig.model_validate_json(first.config_json), overrides or {})
    world = first.world_size
    torch.set_num_threads(int(first.stats.get("threads", 1 if world > 1 else torch.get_num_threads())))
    model, tokenizer, processor, optimizer = ledger.start(first.version_before, config, world)
    scorer = Scorer(model, tokenizer, processor, suppressed_token_ids(tokenizer), ledger.fetch)
    minibatches = [ledger.groups(u.group_ids, config.control, config.grpo.scale_by_std) for u in recorded]
    flat = [flatten(mb) for mb in minibatches]
    shards = [[shard(samples, r, world) for r in range(world)] for samples, _ in flat]
    proximal = (
        [[response_logprobs(scorer, s, config.temperature) for s in ranks] for ranks in shards]
        if len(recorded) > 1
        else None
    )
    ref = ledger.reference(scorer) if config.kl_coef else None
    reference = (
        [[response_logprobs(ref, s, config.temperature) for s in ranks] for ranks in shards]
        if ref is not None
        else None
    )
    pool = ledger.demonstrations(config, first)
    out = []
    for m, (u, (_, num_trajectories)) in enumerate(zip(recorded, flat)):
        step = optimizer_step(
            scorer,
            optimizer,
            config,
            u.update_step,
            shards[m],
            num_trajectories,
            first.version_before,
            proximal[m] if proximal else None,
            reference[m] if reference else None,
            draw_anchor(pool, config, u.update_step, range(world), world),
        )
        loss, tokens = combine(step.scored)
        stats = update_stats(tokens, config) | anchor_stats(step.anchor_nll)
        out.append(
            Replayed(
                u.update_step,
                u.version_before,
                loss,
                step.grad_norm,
                optimizer.sha256(),
                stats,
                full_sha256=weights_sha256(model.state_dict()),
            )
        )
    return out, model, scorer


@torch.no_grad()
def policy_kl(a: Scorer, b: Scorer, samples: list[StepSample], temperature: float = 1.0) -> float:
    """Mean per-token KL(a || b) of two policies' behaviour distributions on `samples`' response tokens."""
    total, count = 0.0, 0
    for s in samples:
        images = [a.fetch(h) for h in s.screenshot_sha256]
        inputs = inputs_from_ids(a.tokenizer, s.prompt_token_ids + s.response_token_ids, images, a.image_processor)
        n = len(s.response_token_ids)
        la = forward_log_softmax(a.model, inputs, n, a.suppress, temperature)  # [n, V]
        lb = forward_log_softmax(b.model, inputs, n, b.suppress, temperature)  # [n, V]
        la, lb = la.double(), lb.double()
        pa = la.exp()
        per_token = (pa * torch.where(pa > 0, la - lb, torch.zeros_like(la))).sum(-1)
        # KL is >= 0; for two nearly equal policies round-off alone can push a token's sum below 0
        total += per_token.clamp_min(0.0).sum().item()
        count += n
    return total / max(count, 1)


@dataclass
class BatchReplay:
    version_before: int
    recorded: list[UpdateApplied]
    same: list[Replayed]
    """The recorded config, replayed."""
    variant: list[Replayed] | None = None
    kl: float | None = None
    """Mean per-token KL(recorded config's result || variant's result) on held-out steps."""

    @property
    def exact(self) -> bool:
        return all(r.matches(u) for r, u in zip(self.same, self.recorded))


def replay(
    settings: StackSettings,
    run_id: str,
    overrides: dict[str, object] | None = None,
    updates: range | None = None,
    heldout_steps: int = 16,
    on_batch=None,
) -> list[BatchReplay]:
    """Replay the run's batches (those holding an update step in `updates`); with `overrides`, also
    the variant and the KL between the two resulting policies on `heldout_steps` steps of other batches."""
    ledger = RunLedger(settings, run_id)
    batches = ledger.batches(updates)
    out = []
    for i, recorded in enumerate(batches):
        same, _, scorer = replay_batch(ledger, recorded)
        result = BatchReplay(recorded[0].version_before, recorded, same)
        if overrides:
            result.variant, _, variant_scorer = replay_batch(ledger, recorded, overrides)
            held = list(itertools.islice(_heldout(ledger, result.version_before), heldout_steps))
            temperature = TrainConfig.model_validate_json(recorded[0].config_json).temperature
            result.kl = policy_kl(scorer, variant_scorer, held, temperature)
        out.append(result)
        if on_batch:
            on_batch(i + 1, len(batches), result)
    return out


def _heldout(ledger: RunLedger, version_before: int) -> Iterator[StepSample]:
    """Steps of the run's other batches, assembled only as far as they are consumed."""
    for batch in ledger.batches():
        if batch[0].version_before != version_before:
            for u in batch:
                yield from flatten(ledger.groups(u.group_ids))[0]


REPORTED = ("loss", "grad_norm", "clip_frac", "weight_mass_failure", "weight_mass_success")


def _value(r: Replayed, key: str) -> float:
    return getattr(r, key) if key in ("loss", "grad_norm") else r.stats.get(key, float("nan"))


def write_report(results: list[BatchReplay], out_dir: Path, title: str) -> Path:
    """Markdown side by side (recorded config vs variant, per optimizer step) and a PNG of the same."""
    from analysis.plotting import plt, save  # here: only reports need matplotlib (a second to load)

    out_dir.mkdir(parents=True, exist_ok=True)
    steps = [(b, s, v) for b in results for s, v in zip(b.same, b.variant or [None] * len(b.same))]
    lines = [
        f"# {title}",
        "",
        f"Bit-exact replay of the recorded config: {sum(b.exact for b in results)}/{len(results)} batches.",
        "",
    ]
    head = ["update", "exact"] + [f"{k} (rec / var)" for k in REPORTED] + ["KL(rec || var)"]
    rows = []
    for b, s, v in steps:
        cells = [str(s.update_step), "yes" if b.exact else "NO"]
        cells += [f"{_value(s, k):.4g} / {_value(v, k):.4g}" if v else f"{_value(s, k):.4g}" for k in REPORTED]
        cells.append("-" if b.kl is None else f"{b.kl:.3g}")
        rows.append(cells)
    lines += markdown_table(head, rows)
    fig, axes = plt.subplots(1, len(REPORTED), figsize=(3.2 * len(REPORTED), 3))
    x = [s.update_step for _, s, _ in steps]
    for ax, key in zip(axes, REPORTED):
        ax.plot(x, [_value(s, key) for _, s, _ in steps], "o-", label="recorded config")
        if any(v for _, _, v in steps):
            ax.plot(x, [_value(v, key) for _, _, v in steps], "s--", label="variant")
        ax.set(title=key, xlabel="update")
    axes[0].legend(fontsize=7)
    fig.suptitle(title)
    save(fig, out_dir / "replay.png", dpi=100)
    lines += ["", "![replay](replay.png)", ""]
    (out_dir / "replay.md").write_text("\n".join(lines))
    return out_dir / "replay.md"
