"""The CLI is validated against the config models: an option named like a config field has its choices
and its default, unless this file says why not."""

from __future__ import annotations

import dataclasses
import inspect
import typing
from pathlib import Path

import pytest
import typer

from analysis.rebatch import Admission
from app import analysis_cli, cli
from app.training import RunConfig
from rollout.evaluate import evaluate
from rollout.run import RolloutRequest
from trainer.config import TrainConfig
from trainer.losses import GRPOConfig
from trainer.sft import SFTConfig

COMMANDS = typer.main.get_command(cli.app).commands


def _defaults(obj) -> dict[str, object]:
    """Field -> default of a pydantic model, a dataclass instance or a function's keyword parameters."""
    if hasattr(obj, "model_fields"):
        return {k: getattr(obj, k) for k in type(obj).model_fields}
    if dataclasses.is_dataclass(obj):
        return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    return {k: p.default for k, p in inspect.signature(obj).parameters.items() if p.default is not p.empty}


CONFIGS = {
    "rollout": [RolloutRequest()],
    "run": [TrainConfig(run_id="-"), RunConfig().rollout, RunConfig()],
    "train": [GRPOConfig(), TrainConfig(run_id="-")],
    "eval": [evaluate],
    "sft": [SFTConfig(run_ids=["-"], out_dir=Path("-"))],
    "rebatch": [Admission()],
}
"""Each command's config models, the last one winning where two name a field."""
DIFFERENT = {
    ("run", "groups_per_update"): "2 groups of the CLI run's 2 workers x G=2, not a trainer's default 4",
    ("run", "curriculum"): "a switch for CurriculumConfig() (the config holds the curriculum itself)",
    ("run", "curriculum_from"): "a list on the command line, a tuple in the config",
    ("train", "run_id"): "required on the command line",
}


@pytest.mark.parametrize("command", sorted(CONFIGS))
def test_options_named_like_config_fields_have_their_defaults(command):
    fields = {}
    for config in CONFIGS[command]:
        fields.update(_defaults(config))
    checked = 0
    for param in COMMANDS[command].params:
        if param.name not in fields or (command, param.name) in DIFFERENT:
            continue
        default, expected = param.default, fields[param.name]
        if isinstance(expected, Path) or isinstance(default, Path):
            default, expected = str(default), str(expected)
        assert default == expected, f"awrl {command} --{param.name}: {default!r}, config: {expected!r}"
        checked += 1
    assert checked >= 1


def test_choice_types_equal_the_config_models():
    assert typing.get_args(cli.Mode) == typing.get_args(typing.get_type_hints(RunConfig)["mode"])
    assert typing.get_args(cli.Loss) == typing.get_args(TrainConfig.model_fields["loss"].annotation)
    assert typing.get_args(cli.Normalizer) == typing.get_args(typing.get_type_hints(GRPOConfig)["normalizer"])
    assert typing.get_args(analysis_cli.Filter) == typing.get_args(typing.get_type_hints(Admission)["filter"])


def test_a_bad_choice_is_refused_with_the_choices_named():
    from typer.testing import CliRunner

    result = CliRunner().invoke(cli.app, ["train", "--run-id", "r", "--normalizer", "median"])
    assert result.exit_code == 2 and "per_trajectory" in result.output
