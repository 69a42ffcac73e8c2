"""Flags and config files of the verbs that run something: `awrl run | demo | train | rollout | sft | eval`.

Options are declared once, in the config objects (`RunConfig`, `LearningConfig`, `TrainConfig`,
`RolloutRequest`, `SFTConfig`, `EvalConfig`, and what they hold): tyro derives every flag, its type,
choices, default and help (the field's docstring) from them, nested configs with dotted names
(`--train.lr`, `--rollout.episode.som`). So a field added to a config is a flag at once, and nothing
is copied by hand.

`--config FILE` (YAML, e.g. what `awrl runs show RUN` prints) or `--config NAME` (a preset below)
replaces the defaults first; flags given beside it override it. A run records its resolved config in
the ledger (`RunStarted`), so any run can be launched again from `awrl runs show`.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated, Any, TypeVar

import pydantic
import tyro
import yaml

from app.errors import ConfigError
from app.learning import READING_ANCHOR, READING_DEMOS, READING_TRAIN, READING_UPDATES, LearningConfig, controlled
from app.output import Format
from app.training import RunConfig
from pipeline.settings import stack_dir
from rollout.evaluate import EvalConfig
from rollout.run import RolloutRequest
from trainer.config import TrainConfig
from trainer.launch import Nodes
from trainer.sft import SFTConfig

T = TypeVar("T")
Flat = tyro.conf.arg(name="")
"""The wrapped config's fields are the verb's own flags (`--lr`, not `--train.lr`)."""


@dataclass(frozen=True)
class TrainCommand:
    train: Annotated[TrainConfig, Flat] = TrainConfig(run_id=os.environ.get("AWRL_RUN_ID", ""))
    nproc: int = 1
    """Trainer processes on this node (torchrun --nproc_per_node); FSDP2 shards over all of them."""
    nodes: Annotated[Nodes, Flat] = Nodes()


@dataclass(frozen=True)
class RunCommand:
    run: Annotated[RunConfig, Flat] = RunConfig()
    data_dir: Path = stack_dir()
    """The embedded stack's directory (started there unless AWRL_* settings name another stack)."""
    format: Format = Format.table
    """The summary as table (for people), json, csv or markdown."""


DEMO = LearningConfig(
    suite="miniwob",
    demo_episodes=100,
    sft_epochs=4,
    rl_minutes=5.0,
    eval_episodes=64,
    workers=2,
    out_dir=Path(".awrl/learning"),
)
"""`make demo`: MiniWoB++ Easy, which the tiny model learns on CPU (bench/RESULTS.md)."""


@dataclass(frozen=True)
class DemoCommand:
    learning: Annotated[LearningConfig, Flat] = DEMO
    data_dir: Path = stack_dir()
    """The embedded stack's directory (started there unless AWRL_* settings name another stack)."""
    keep: bool = True
    """Leave a stack the demo started running, for `dagster dev` and `awrl sql`."""
    format: Format = Format.table
    """The summary as table (for people), json, csv or markdown."""


def _rollout_from_env() -> RolloutRequest:
    """`RolloutRequest`'s defaults, with the run id and the journal from the environment where set
    (`AWRL_RUN_ID`, `AWRL_ROLLOUT_JOURNAL`: a pool process as deployed)."""
    req = RolloutRequest()
    if run_id := os.environ.get("AWRL_RUN_ID"):
        req = replace(req, run_id=run_id)
    if journal := os.environ.get("AWRL_ROLLOUT_JOURNAL"):
        req = replace(req, journal_dir=Path(journal))
    return req


@dataclass(frozen=True)
class RolloutCommand:
    rollout: Annotated[RolloutRequest, Flat] = field(default_factory=_rollout_from_env)
    forever: bool = False
    """Run until interrupted (the same as --episodes None)."""
    eta: int | None = None
    """Staleness bound: dispatch only what a trainer with this eta (and --groups-per-update) can use."""
    groups_per_update: int = TrainConfig.model_fields["groups_per_update"].default
    """The trainer's groups per update (with --eta)."""
    format: Format = Format.table
    """The summary as table (for people), json, csv or markdown."""

    def __post_init__(self) -> None:
        if self.rollout.max_batch < 1:
            raise ValueError(f"max-batch: must be at least 1, got {self.rollout.max_batch}")
        if self.eta is not None and self.eta < 0:
            raise ValueError(f"eta: must be at least 0, got {self.eta}")
        if self.groups_per_update < 1:
            raise ValueError(f"groups-per-update: must be at least 1, got {self.groups_per_update}")


@dataclass(frozen=True)
class SFTCommand:
    sft: Annotated[SFTConfig, Flat] = SFTConfig(run_ids=[], out_dir=Path(".awrl/models/sft"))
    format: Format = Format.table
    """The summary as table (for people), json, csv or markdown."""


@dataclass(frozen=True)
class EvalCommand:
    evaluation: Annotated[EvalConfig, Flat] = EvalConfig()
    format: Format = Format.table
    """The result as table (for people), json, csv or markdown."""


PRESETS: dict[type, dict[str, Callable[[], Any]]] = {
    LearningConfig: {
        "demo": lambda: DEMO,
        "controlled": lambda: controlled("", Path(".awrl/learning")),
        "colour": lambda: controlled(
            "",
            Path(".awrl/learning"),
            target="colour",
            rl_updates=READING_UPDATES,
            rl_minutes=40.0,
            train=READING_TRAIN,
            anchor_coef=READING_ANCHOR,
            demo_templates=READING_DEMOS,
        ),
    },
}
"""`--config NAME`: the configurations the project studies, by name (bench/RESULTS.md uses them).
`controlled` is the controlled task with a constant target (`red`); `colour` the one that needs the
instruction, with the SFT anchor: the controlled learning test (tests/test_learning.py). With
`--train.control shuffled_rewards` either is its negative control."""
COMMANDS: dict[str, type] = {
    "demo": DemoCommand,
    "run": RunCommand,
    "train": TrainCommand,
    "rollout": RolloutCommand,
    "sft": SFTCommand,
    "eval": EvalCommand,
}
"""The command object of each verb that runs something (`app.run_cli.CONFIG_VERBS`)."""
WRAPPED = {
    TrainCommand: "train",
    RunCommand: "run",
    DemoCommand: "learning",
    RolloutCommand: "rollout",
    SFTCommand: "sft",
    EvalCommand: "evaluation",
}
"""Each command's field holding the config that `--config` loads (and, for the first three, that
`RunStarted` records)."""


def parse(command: type[T], args: Sequence[str], prog: str, description: str) -> T:
    """The verb's command object from its arguments: `--config` first, then every other flag over it.
    tyro prints help (`--help`) or a usage error and exits 0 or 2 itself; a value a config refuses
    (e.g. `--lr -1`) raises `ConfigError`."""
    args, source = _pop_config(list(args))
    default = command()
    if source is not None:
        field = WRAPPED[command]
        default = replace(default, **{field: load(getattr(default, field), source)})
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            return tyro.cli(command, args=args, default=default, prog=prog, description=description + _CONFIG_HELP)
    except (pydantic.ValidationError, ValueError) as exc:
        raise ConfigError(_one_line(exc)) from None
    except SystemExit as exc:
        if exc.code in (0, None):
            raise
        # tyro draws its usage errors in a box; the CLI's convention is one line
        raise ConfigError(" ".join(re.sub(r"[\u2500-\u257f]|-{3,}", " ", stderr.getvalue()).split())) from None


_CONFIG_HELP = (
    "\n\n--config FILE|NAME: start from a YAML config (`awrl runs show RUN` prints one) or a preset "
    f"({', '.join(n for p in PRESETS.values() for n in p)}); the flags override it."
)


def _pop_config(args: list[str]) -> tuple[list[str], str | None]:
    for i, arg in enumerate(args):
        if arg == "--config":
            if i + 1 == len(args):
                raise ConfigError("--config takes a YAML file or a preset name")
            return args[:i] + args[i + 2 :], args[i + 1]
        if arg.startswith("--config="):
            return args[:i] + args[i + 1 :], arg.split("=", 1)[1]
    return args, None


def load(base: T, source: str) -> T:
    """A config from a preset name, or a YAML file over `base` (the verb's defaults: keys the file does
    not name keep them)."""
    presets = PRESETS.get(type(base), {})
    if source in presets:
        return presets[source]()
    path = Path(source)
    if not path.is_file():
        known = f" or a preset ({', '.join(presets)})" if presets else ""
        raise ConfigError(f"--config {source}: no such file{known}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not YAML: {_one_line(exc)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of config fields, got {type(data).__name__}")
    try:
        return from_dict(base, data)
    except pydantic.ValidationError as exc:
        raise ConfigError(f"{path}: {_one_line(exc)}") from None
    except ValueError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def from_dict(base: T, data: dict) -> T:
    """`base` with the fields `data` names replaced, validated as a whole."""
    return pydantic.TypeAdapter(type(base)).validate_python(_merge(to_dict(base), data))


def to_dict(config) -> dict:
    """The config as plain data (paths and tuples as strings and lists), as YAML and JSON hold it."""
    return pydantic.TypeAdapter(type(config)).dump_python(config, mode="json")


def to_yaml(data: dict, header: str = "") -> str:
    out = io.StringIO()
    if header:
        out.write("".join(f"# {line}\n" for line in header.splitlines()))
    yaml.safe_dump(data, out, sort_keys=False, default_flow_style=False)
    return out.getvalue()


def _merge(base: dict, over: dict, where: str = "") -> dict:
    out = dict(base)
    for key, value in over.items():
        if key not in base:
            raise ConfigError(f"unknown field {where}{key} (known: {', '.join(base)})")
        if isinstance(base[key], dict) and isinstance(value, dict):
            value = _merge(base[key], value, f"{where}{key}.")
        out[key] = value
    return out


def _one_line(exc: Exception) -> str:
    if isinstance(exc, pydantic.ValidationError):
        errors = exc.errors(include_url=False)
        return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'value'}: {e['msg']}" for e in errors[:3])
    return " ".join(str(exc).split())
