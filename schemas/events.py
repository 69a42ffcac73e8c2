"""The event vocabulary: every fact the system records, as a frozen pydantic model.

Events are past-tense facts, immutable once emitted (eventsourcing's convention). Every table of the
ledger, every trainer batch and every replay is a fold over these. The Arrow/Parquet schemas are derived
from these classes (`schemas.arrow`), so a field is declared here and nowhere else.

Bump `SCHEMA_VERSION` on any change a reader of old Parquet files must know about.
"""

from __future__ import annotations

import base64
import sys
import uuid
from array import array
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated, ClassVar, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PlainSerializer, TypeAdapter, model_validator

from schemas.actions import Action
from schemas.arrow import Int64

SCHEMA_VERSION = 10
"""2: GroupDropped; UpdateApplied timings and staleness; PolicyVersionPublished lineage.
3: EvaluationCompleted (a learning curve's points).
4: UpdateApplied.memory (per-rank bytes of the sharded trainer; null in older files).
5: RunStarted (a run's resolved configuration).
6: GroupDropped.mean_reward and .invalid_share (why a run starves; null in older files).
7: PolicyVersionLoaded (how a sampler got each version); PolicyVersionPublished.push_s.
8: StepRecorded.marks and .marks_drawn (the Set-of-Mark elements of each screen; empty in older files).
9: EvaluationCompleted.temperature, .samples and .invalid_share (a paired evaluation; null in older files).
10: TrajectoryJudged (a model judge's verdicts, and the rule's beside them); the outcome `judge_error`."""
Sha256 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
Outcome = Literal["success", "failure", "env_error", "judge_error"]
"""`judge_error`: the judge that gives the reward could not say (down, refusing, unparseable after its
retries); the group is dropped with that reason, never counted as a success or a failure."""


def packed_bytes(value: str, itemsize: int) -> bytes:
    """The little-endian bytes of a packed array (base64 in JSON); ValueError unless valid base64 of
    whole values. The one check both decoders apply (`decode_event`, and the ledger's column-wise
    `schemas.columnar`), so they accept and reject the same messages."""
    data = base64.b64decode(value, validate=True)
    if len(data) % itemsize:
        raise ValueError(f"{len(data)} bytes are not a whole number of {itemsize}-byte values")
    return data


@dataclass(frozen=True)
class Packed:
    """Marks a packed array field (`PackedInts`, `PackedFloats`) with its wire dtype."""

    dtype: str
    """numpy dtype of one value on the wire (little-endian)."""


def _packed(code: str, dtype: str):
    """Token arrays travel as base64 of little-endian machine arrays in JSON (a list is accepted too).

    A step carries ~1.5k numbers; as JSON text they cost ~2x the bytes and most of the decode time
    (measured: 3k vs 6k+ events/s per core). In Python and in Arrow they stay plain lists.
    """
    itemsize = array(code).itemsize

    def unpack(value):
        if not isinstance(value, str):
            return value
        a = array(code)
        a.frombytes(packed_bytes(value, itemsize))
        if sys.byteorder != "little":
            a.byteswap()
        return a.tolist()

    def pack(values) -> str:
        a = array(code, values)
        if sys.byteorder != "little":
            a.byteswap()
        return base64.b64encode(a.tobytes()).decode()

    return BeforeValidator(unpack), PlainSerializer(pack, when_used="json"), Packed(dtype)


PackedInts = Annotated[list[Int64], *_packed("i", "<i4")]
"""int32 values: token ids and policy versions."""
PackedFloats = Annotated[list[float], *_packed("d", "<f8")]
"""float64 values: log-probs, bit-exact through the wire."""


def _new_id() -> str:
    return uuid.uuid4().hex


def _now() -> datetime:
    return datetime.now(UTC)


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


RUN_ID_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9._+-]{0,199}$"
"""A run id names a directory of the ledger and a prefix of the store: no `/`, no `..` escapes, no
`=` (it would break the Hive partition layout)."""
RunId = Annotated[str, Field(pattern=RUN_ID_PATTERN)]


class Event(Frozen):
    """Fields every event carries."""

    event_id: str = Field(default_factory=_new_id)
    """Globally unique id; the ledger deduplicates on it (exactly-once comes from here, not Kafka)."""
    run_id: RunId
    """The training run this fact belongs to; the ledger partitions by it."""
    schema_version: Int64 = SCHEMA_VERSION
    """Version of this vocabulary the event was written with."""
    emitted_at: datetime = Field(default_factory=_now)
    """UTC time the producer created the event."""
    topic: ClassVar[str]
    """Name of the topic that carries it (`pipeline.topics`): its order guarantees come from there."""


class TaskGroupDispatched(Event):
    """The dispatcher asked the rollout pool for G episodes of one task (one GRPO group)."""

    event_type: Literal["TaskGroupDispatched"] = "TaskGroupDispatched"
    topic: ClassVar[str] = "tasks"
    group_id: str
    task_id: str
    suite: str
    seed: Int64
    group_size: Int64 = Field(ge=1)
    horizon: Int64 = Field(ge=1)
    """Maximum steps per episode (Easy 10, Medium 20, Hard 30)."""
    dispatched_at_version: Int64 = Field(ge=0)
    """Trainer policy version when dispatched; the staleness budget is computed from it."""


class EpisodeStarted(Event):
    event_type: Literal["EpisodeStarted"] = "EpisodeStarted"
    topic: ClassVar[str] = "rollout"
    trajectory_id: str
    group_id: str
    task_id: str
    worker_id: str
    instruction: str
    horizon: Int64 = Field(ge=1)
    policy_version: Int64 = Field(ge=0)
    """Version loaded when the episode began; later steps may use newer ones (in-place refresh)."""


class StepTimings(Frozen):
    policy_s: float = Field(ge=0)
    """Time the policy took to produce the response."""
    browser_s: float = Field(ge=0)
    """Time executing the action and taking the screenshot."""
    wait_s: float = Field(ge=0)
    """Time waiting for the page to settle."""


class StepMark(Frozen):
    """One Set-of-Mark element of a step's screen: its id, what it is, and its box in CSS pixels."""

    id: Int64
    role: str
    name: str
    x: Int64
    y: Int64
    width: Int64
    height: Int64


class StepRecorded(Event):
    """One agent step. Pixels are referenced by sha256 in the screenshot store, never carried here."""

    event_type: Literal["StepRecorded"] = "StepRecorded"
    topic: ClassVar[str] = "rollout"
    trajectory_id: str
    group_id: str
    task_id: str
    step: Int64 = Field(ge=0)
    screenshot_sha256: Sha256
    """The observation screenshot this step acted on."""
    url: str
    action: Action
    response_text: str
    memory: dict[str, str]
    """The agent's accumulated `memory` object after this step (values as text)."""
    prompt_token_ids: PackedInts
    """Exact model input ids, so training and replay rebuild the input without re-rendering."""
    prompt_screenshot_sha256: list[Sha256]
    """Screenshots in the prompt, in prompt order (the last K observations)."""
    response_token_ids: PackedInts
    behave_logprobs: PackedFloats
    """log pi_behave of each response token, from the sampler."""
    token_policy_versions: PackedInts
    """Policy version that produced each response token (weights may refresh mid-episode)."""
    policy_version: Int64 = Field(ge=0)
    """Version loaded when this step was sampled (also for scripted policies, which have no tokens)."""
    env_feedback: str
    """Text the environment reported back (what the action did)."""
    error_class: str | None = None
    """Set when the step failed: `invalid_action`, `timeout`, `browser_crash`, ..."""
    timings: StepTimings
    marks: list[StepMark] = Field(default_factory=list)
    """The screen's Set-of-Mark elements (computed in every mode: the environment acts on them), so a
    viewer can draw them on a plain screenshot. Empty in events older than `SCHEMA_VERSION` 8."""
    marks_drawn: bool = False
    """Whether `screenshot_sha256` already has the marks drawn on it (Set-of-Mark mode)."""

    @model_validator(mode="after")
    def _aligned_tokens(self) -> StepRecorded:
        n = len(self.response_token_ids)
        if len(self.behave_logprobs) != n or len(self.token_policy_versions) != n:
            raise ValueError(
                f"response_token_ids ({n}), behave_logprobs ({len(self.behave_logprobs)}) and "
                f"token_policy_versions ({len(self.token_policy_versions)}) must have equal length"
            )
        return self


class EpisodeFinished(Event):
    event_type: Literal["EpisodeFinished"] = "EpisodeFinished"
    topic: ClassVar[str] = "rollout"
    trajectory_id: str
    group_id: str
    task_id: str
    outcome: Outcome
    reward: float
    """Trajectory reward from the judge: 1.0 success, 0.0 otherwise (`EpisodeConfig.malformed_reward`
    for a failure with a malformed action, when set)."""
    num_steps: Int64 = Field(ge=0)
    reason: str
    """Why it ended: judge verdict, horizon reached, or the environment error."""
    answer: str | None = None


class TrajectoryJudged(Event):
    """One judge's verdict on one trajectory (`rollout.judges`). A run whose reward comes from a model
    judge records the model's verdict and the rule judge's beside it, so agreement and reward hacking
    are queries (`verdicts` view); replay reads the rewards from `EpisodeFinished`, never the judge."""

    event_type: Literal["TrajectoryJudged"] = "TrajectoryJudged"
    topic: ClassVar[str] = "rollout"
    trajectory_id: str
    group_id: str
    task_id: str
    judge: str
    """`rule` (the suite's own judge) or `model`."""
    judge_version: str
    """The judge's code version: a change that can change verdicts bumps it."""
    gives_reward: bool
    """This judge's verdict is the trajectory's reward (`EpisodeConfig.judge`)."""
    success: bool | None
    """The verdict; None when the judge could not give one (`error`)."""
    reason: str
    model: str = ""
    """The model that judged (empty for the rule judge)."""
    prompt_sha256: str = ""
    """sha256 of the prompt template (empty for the rule judge): verdicts of different prompts differ."""
    response_text: str = ""
    """The model's whole answer, as parsed (the last attempt's)."""
    error: str | None = None
    """Why there is no verdict, after `attempts` tries."""
    attempts: Int64 = 1
    latency_s: float = 0.0
    """Wall time of the judging, retries and back-off included."""
    prompt_tokens: Int64 | None = None
    completion_tokens: Int64 | None = None


class GroupCompleted(Event):
    """All G episodes of a task group ended; the group is ready for advantages and training."""

    event_type: Literal["GroupCompleted"] = "GroupCompleted"
    topic: ClassVar[str] = "rollout"
    group_id: str
    task_id: str
    trajectory_ids: list[str]
    rewards: list[float]
    num_steps: list[Int64]
    """Steps per trajectory, so a consumer knows when it holds every step of the group."""
    outcomes: list[Outcome]
    min_policy_version: Int64
    max_policy_version: Int64

    @model_validator(mode="after")
    def _aligned(self) -> GroupCompleted:
        n = len(self.trajectory_ids)
        if not (len(self.rewards) == len(self.num_steps) == len(self.outcomes) == n):
            raise ValueError("trajectory_ids, rewards, num_steps and outcomes must have equal length")
        return self


class RankMemory(BaseModel):
    """One trainer rank's memory during an optimizer step."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rank: Int64 = Field(ge=0)
    params_bytes: Int64 = Field(ge=0)
    """This rank's parameter shards."""
    grads_bytes: Int64 = Field(ge=0)
    """This rank's gradient shards."""
    optimizer_bytes: Int64 = Field(ge=0)
    """This rank's optimizer state (AdamW's two moments and step counters)."""
    peak_bytes: Int64 = Field(ge=0)
    """High-water mark during the step: the CUDA allocator's peak on GPU, the process's peak resident
    set on CPU (which includes the Python runtime and libraries, some hundreds of MB)."""
    device: Literal["cpu", "cuda"]


class UpdateApplied(Event):
    """One optimizer step of the trainer, with the exact batch and what it did."""

    event_type: Literal["UpdateApplied"] = "UpdateApplied"
    topic: ClassVar[str] = "trainer"
    update_step: Int64 = Field(ge=0)
    version_before: Int64 = Field(ge=0)
    version_after: Int64 = Field(ge=0)
    group_ids: list[str]
    trajectory_ids: list[str]
    loss: float
    grad_norm: float
    stats: dict[str, float]
    """Loss statistics (clip fraction, staleness weights, KL, entropy, the sampler-vs-trainer `mismatch_*`
    of `trainer/mismatch.py`, ...), detached; finite (NaN and infinity do not survive the JSON)."""
    config_json: str
    """The trainer config of this update, so replay can rebuild it."""
    weights_sha256: Sha256
    """Hash of the weights after the update (replay checks bit-exactness against it)."""
    duration_s: float = Field(ge=0)
    """Wall time of the whole update: waiting for data + computing (publishing is on the version)."""
    wait_s: float = Field(default=0.0, ge=0)
    """Time the trainer waited for admissible groups (idle time)."""
    compute_s: float = Field(default=0.0, ge=0)
    """Time in forward/backward/optimizer, all ranks in lock step."""
    world_size: Int64 = Field(default=1, ge=1)
    """Trainer processes that computed this update (FSDP2 data parallel)."""
    memory: list[RankMemory] | None = None
    """Each rank's memory, in rank order (None in events older than `SCHEMA_VERSION` 4)."""


class PolicyVersionPublished(Event):
    """A checkpoint is in the object store; rollout workers refresh to it between steps."""

    event_type: Literal["PolicyVersionPublished"] = "PolicyVersionPublished"
    topic: ClassVar[str] = "trainer"
    version: Int64 = Field(ge=0)
    checkpoint_uri: str
    checkpoint_sha256: Sha256
    """`pipeline.hashing.weights_sha256` of the weights as the checkpoint's safetensors hold them."""
    update_step: Int64 | None = None
    """The update that produced it; None for the initial policy."""
    parent_version: Int64 | None = None
    """The version these weights were trained from (lineage); None for the initial policy."""
    update_ids: list[str] = Field(default_factory=list)
    """`event_id`s of the `UpdateApplied` events that produced it from the parent (lineage)."""
    publish_s: float = Field(default=0.0, ge=0)
    """Time from the end of its update until it was durable in the object store (the trainer ran the
    next update meanwhile)."""
    push_s: float | None = Field(default=None, ge=0)
    """Time to push the weights straight to a sampler (`model.push`); None when none was connected
    (how each sampler got the version: `PolicyVersionLoaded`)."""


class GroupDropped(Event):
    """The trainer consumed a group without training on it; dropped groups are counted, never silent."""

    event_type: Literal["GroupDropped"] = "GroupDropped"
    topic: ClassVar[str] = "trainer"
    group_id: str
    task_id: str
    reason: Literal[
        "stale",
        "uninformative",
        "no_tokens",
        "screenshot_corrupted",
        "screenshot_missing",
        "steps_missing",
        "judge_error",
    ]
    """`stale`: a token older than the staleness bound; `uninformative`: all rewards equal (dynamic
    sampling); `no_tokens`: no step carries model tokens (scripted policies); `screenshot_corrupted`:
    a stored screenshot no longer hashes to its key; `screenshot_missing`: one is not in the store;
    `steps_missing`: the group was announced complete but a step it names had not arrived when its
    oldest version left the staleness bound (`trainer.batch`); `judge_error`: the judge that gives the
    reward gave no verdict on one of its trajectories (`rollout.judges`).
    (New values need no `SCHEMA_VERSION` bump: the column stays a string and old files hold old values.)"""
    trainer_version: Int64 = Field(ge=0)
    """The trainer's version when it dropped the group."""
    min_policy_version: Int64 = Field(ge=0)
    """Oldest behaviour version in the group."""
    mean_reward: float | None = None
    """The group's mean reward (an uninformative group's rewards are all this)."""
    invalid_share: float | None = None
    """Share of the group's steps whose model output was not a valid action."""


class EvaluationCompleted(Event):
    """A policy's success rate on a task split, measured by an evaluation run (a point of a learning
    curve). `run_id` is the run being evaluated; the episodes themselves are the events of `eval_run_id`."""

    event_type: Literal["EvaluationCompleted"] = "EvaluationCompleted"
    topic: ClassVar[str] = "trainer"
    stage: str
    """What was evaluated, e.g. `untrained`, `sft`, `rl`."""
    eval_run_id: RunId
    policy_version: Int64 = Field(ge=0)
    checkpoint_sha256: Sha256 | None = None
    """Hash of the evaluated weights (None for a scripted policy)."""
    suite: str
    split: str
    difficulty: str | None = None
    episodes: Int64 = Field(ge=0)
    successes: Int64 = Field(ge=0)
    ci95_low: float = Field(ge=0, le=1)
    ci95_high: float = Field(ge=0, le=1)
    """Wilson 95% interval of the success rate."""
    train_s: float = Field(default=0.0, ge=0)
    """Training wall time spent to reach this policy (SFT + RL so far)."""
    temperature: float | None = None
    """Sampling temperature of the evaluated policy (None in older files)."""
    samples: Int64 | None = Field(default=None, ge=1)
    """Episodes per instance: each instance ran as one group of this size (`rollout.evaluate`'s
    paired evaluation; `episodes` / `samples` instances). None: independent single episodes."""
    invalid_share: float | None = Field(default=None, ge=0, le=1)
    """Share of the evaluation's steps whose model output was not a valid action."""


class PolicyVersionLoaded(Event):
    """A sampler (a rollout pool's policy) loaded a published version, and how it got there."""

    event_type: Literal["PolicyVersionLoaded"] = "PolicyVersionLoaded"
    topic: ClassVar[str] = "rollout"
    version: Int64 = Field(ge=0)
    checkpoint_sha256: Sha256
    """The digest the version's `PolicyVersionPublished` named (and the pushed weights matched)."""
    delivery: Literal["push", "store"]
    """`push`: the trainer's direct weight push (`model.push`); `store`: the checkpoint in the object store."""
    load_s: float = Field(ge=0)
    """Time the sampler spent getting and loading the weights."""
    since_published_s: float
    """From the version event's `emitted_at` to loaded (clocks of two hosts: approximate across hosts)."""


class RunStarted(Event):
    """A command started (or restarted) a run, with its whole resolved configuration: what `awrl runs
    show` prints and `awrl <command> --config` launches again."""

    event_type: Literal["RunStarted"] = "RunStarted"
    topic: ClassVar[str] = "trainer"
    command: str
    """The `awrl` verb that started it: `run`, `demo` or `train`."""
    config_json: str
    """The verb's config object with every default resolved, as JSON (`app.configs`)."""
    argv: list[str] = Field(default_factory=list)
    """The command line as typed (the config is what counts; this is for people)."""
    package_version: str = ""
    """Version of the `asyncwebrl` package that ran it."""
    host: str = ""


EVENT_TYPES: tuple[type[Event], ...] = (
    RunStarted,
    TaskGroupDispatched,
    EpisodeStarted,
    StepRecorded,
    EpisodeFinished,
    TrajectoryJudged,
    GroupCompleted,
    UpdateApplied,
    PolicyVersionPublished,
    GroupDropped,
    EvaluationCompleted,
    PolicyVersionLoaded,
)
AnyEvent = Annotated[Union[EVENT_TYPES], Field(discriminator="event_type")]  # noqa: UP007 - a Union over a tuple of classes
EVENT_ADAPTER: TypeAdapter[Event] = TypeAdapter(AnyEvent)
BY_NAME: dict[str, type[Event]] = {cls.__name__: cls for cls in EVENT_TYPES}


def decode_event(raw: bytes | str) -> Event:
    """Parse JSON into the right event class; raises `pydantic.ValidationError` on anything else."""
    return EVENT_ADAPTER.validate_json(raw)


def encode_event(event: Event) -> bytes:
    return event.model_dump_json().encode()
