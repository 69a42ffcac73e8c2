"""The `awrl` CLI as users meet it: flags derived from the configs, config files and presets, runs
recorded and launched again, settings found in one order, machine output never wrapped, and a table
of users' mistakes, each ending in one line and the convention's exit code, never a traceback."""

from __future__ import annotations

import dataclasses
import inspect
import json
import subprocess
import sys
import typing
from pathlib import Path

import pydantic
import pytest
import typer

from analysis.rebatch import Admission
from app import analysis_cli, cli
from app.configs import (
    DEMO,
    DemoCommand,
    EvalCommand,
    RolloutCommand,
    RunCommand,
    SFTCommand,
    TrainCommand,
    parse,
    to_dict,
    to_yaml,
)
from app.learning import LearningConfig, controlled
from app.output import human
from app.training import RunConfig
from pipeline.settings import StackSettings
from rollout.evaluate import EvalConfig, evaluate, evaluate_paired
from rollout.run import RolloutRequest
from schemas import RunStarted
from trainer.config import TrainConfig
from trainer.sft import SFTConfig

COMMANDS = typer.main.get_command(cli.app).commands


# -- flags derived from the configs -------------------------------------------------------------------


def _leaves(config, prefix: str = "") -> list[str]:
    """Every leaf field of a config (pydantic model or dataclass), as its flag: `--train.grpo.k`."""
    names = (
        list(type(config).model_fields)
        if isinstance(config, pydantic.BaseModel)
        else [f.name for f in dataclasses.fields(config)]
    )
    out = []
    for name in names:
        value = getattr(config, name)
        flag = prefix + name.replace("_", "-")
        nested = isinstance(value, pydantic.BaseModel) or dataclasses.is_dataclass(value)
        out += _leaves(value, flag + ".") if nested else [f"--{flag}"]
    return out


@pytest.mark.parametrize(
    "command, config",
    [
        (TrainCommand, TrainConfig(run_id="")),
        (RunCommand, RunConfig()),
        (DemoCommand, LearningConfig()),
        (RolloutCommand, RolloutRequest()),
        (SFTCommand, SFTConfig(run_ids=[], out_dir=Path("-"))),
        (EvalCommand, EvalConfig()),
    ],
    ids=["train", "run", "demo", "rollout", "sft", "eval"],
)
def test_every_config_field_is_a_flag(command, config, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse(command, ["--help"], "awrl x", "")
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    missing = [flag for flag in _leaves(config) if f"{flag} " not in text and f"{flag}," not in text]
    assert not missing, f"fields without a flag: {missing}"


def test_flags_set_nested_fields_and_refuse_what_the_run_sets():
    cmd = parse(
        RunCommand,
        [
            "--train.lr",
            "3e-5",
            "--train.grpo.normalizer",
            "token",
            "--rollout.episode.no-som",
            "--minutes",
            "2",
            "--rollout.curriculum.enabled",
        ],
        "awrl run",
        "",
    )
    assert (cmd.run.train.lr, cmd.run.train.grpo.normalizer, cmd.run.rollout.episode.som) == (3e-5, "token", False)
    assert cmd.run.rollout.curriculum.enabled and cmd.run.minutes == 2
    from app.errors import ConfigError

    with pytest.raises(ConfigError, match="--train.run-id is set by the run: use --run-id"):
        parse(RunCommand, ["--train.run-id", "x"], "awrl run", "")


def test_config_files_and_presets(tmp_path):
    config = controlled("", Path(".awrl/learning"))
    assert parse(DemoCommand, ["--config", "controlled"], "awrl demo", "").learning == config
    shuffled = parse(DemoCommand, ["--config", "controlled", "--train.control", "shuffled_rewards"], "awrl demo", "")
    assert shuffled.learning.train.control == "shuffled_rewards" and shuffled.learning.suite == "boxes"
    assert parse(DemoCommand, [], "awrl demo", "").learning == DEMO
    colour = parse(DemoCommand, ["--config", "colour"], "awrl demo", "").learning
    assert (colour.templates, colour.anchor_coef, colour.train.tokens.pg) == (("colour",), 1.0, "action")
    assert colour.demo_templates == ("named", "pick")
    # a file names only what differs; flags beside it win
    (tmp_path / "c.yaml").write_text("suite: boxes\ntrain:\n  lr: 2.0e-4\n  grpo:\n    normalizer: token\n")
    got = parse(DemoCommand, ["--config", str(tmp_path / "c.yaml"), "--train.lr", "5e-5"], "awrl demo", "").learning
    assert (got.suite, got.train.lr, got.train.grpo.normalizer, got.train.kl_coef) == ("boxes", 5e-5, "token", 1.0)
    # a whole config written out reads back equal
    (tmp_path / "all.yaml").write_text(to_yaml(to_dict(config)))
    assert parse(DemoCommand, ["--config", str(tmp_path / "all.yaml")], "awrl demo", "").learning == config


def test_rollout_sft_and_eval_flags_set_their_configs(monkeypatch):
    monkeypatch.setenv("AWRL_RUN_ID", "from-env")
    monkeypatch.setenv("AWRL_ROLLOUT_JOURNAL", "/tmp/journal")
    cmd = parse(
        RolloutCommand,
        ["--temperature", "0.5", "--episode.som", "--curriculum.enabled", "--forever", "--eta", "2"],
        "awrl rollout",
        "",
    )
    req = cmd.rollout
    assert (req.temperature, req.episode.som, req.curriculum.enabled, req.run_id, str(req.journal_dir)) == (
        0.5,
        True,
        True,
        "from-env",
        "/tmp/journal",
    )
    assert cmd.forever and cmd.eta == 2 and cmd.groups_per_update == TrainConfig(run_id="").groups_per_update
    sft = parse(SFTCommand, ["--run-ids", "a", "b", "--epochs", "2"], "awrl sft", "").sft
    assert (sft.run_ids, sft.epochs) == (["a", "b"], 2)
    ev = parse(EvalCommand, ["--models", "m1", "m2", "--labels", "x", "y", "--instances", "8"], "awrl eval", "")
    assert (ev.evaluation.models, ev.evaluation.labels, ev.evaluation.instances) == (
        (Path("m1"), Path("m2")),
        ("x", "y"),
        8,
    )


def test_check_args_parses_every_verb_without_running_it():
    assert cli.check_args(["rollout", "--episode.som", "--forever", "--eta", "2"]) is None
    assert cli.check_args(["eval", "--help"]) is None
    assert "--som" in cli.check_args(["rollout", "--som"])
    assert "invalid choice 'nope'" in cli.check_args(["sft", "--format", "nope"])
    assert "No such option: --nope" in cli.check_args(["sql", "x", "--nope"])


# -- defaults stated twice ---------------------------------------------------------------------------------


def _defaults(obj) -> dict[str, object]:
    """Field -> default of a pydantic model, a dataclass instance or a function's keyword parameters."""
    if isinstance(obj, pydantic.BaseModel):
        return {k: getattr(obj, k) for k in type(obj).model_fields}
    if dataclasses.is_dataclass(obj):
        return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    return {k: p.default for k, p in inspect.signature(obj).parameters.items() if p.default is not p.empty}


CONFIGS = {"rebatch": [Admission()]}
"""`rebatch` keeps a few hand-written typer options: each must match its config."""


@pytest.mark.parametrize("command", sorted(CONFIGS))
def test_options_named_like_config_fields_have_their_defaults(command):
    fields = {}
    for config in CONFIGS[command]:
        fields.update(_defaults(config))
    checked = 0
    for param in COMMANDS[command].params:
        if param.name not in fields:
            continue
        default, expected = param.default, fields[param.name]
        if isinstance(expected, Path) or isinstance(default, Path):
            default, expected = str(default), str(expected)
        assert default == expected, f"awrl {command} --{param.name}: {default!r}, config: {expected!r}"
        checked += 1
    assert checked >= 1


@pytest.mark.parametrize("function", [evaluate, evaluate_paired])
def test_eval_config_defaults_are_the_evaluation_functions(function):
    """`awrl eval` takes `EvalConfig`; the functions it calls keep keyword defaults for library callers."""
    config, defaults = _defaults(EvalConfig()), _defaults(function)
    shared = sorted(set(config) & set(defaults))
    assert len(shared) >= 6 and {k: config[k] for k in shared} == {k: defaults[k] for k in shared}


def test_choice_types_equal_the_config_models():
    assert typing.get_args(analysis_cli.Filter) == typing.get_args(typing.get_type_hints(Admission)["filter"])


# -- runs in the ledger, launched again ------------------------------------------------------------------

RESOLVED = RunConfig(
    run_id="r1",
    rollout=dataclasses.replace(RunConfig().rollout, model_dir=Path("m")),
    train=TrainConfig(run_id="r1", groups_per_update=2, model_dir=Path("m"), lr=3e-5),
)


@pytest.fixture(scope="module")
def ledger(tmp_path_factory) -> Path:
    from test_analysis import run_r1, write_ledger

    root = tmp_path_factory.mktemp("cli-ledger")
    started = RunStarted(
        run_id="r1",
        command="run",
        config_json=pydantic.TypeAdapter(RunConfig).dump_json(RESOLVED).decode(),
        argv=["awrl", "run"],
    )
    write_ledger(root, [started, *run_r1()])
    return root


def test_runs_lists_the_ledger_and_show_launches_a_run_again(ledger, tmp_path, capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["runs", "--format", "json", "--ledger", str(ledger)])
    assert done.value.code == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert (row["run_id"], row["command"], row["episodes"], row["success"]) == ("r1", "run", 4, 0.25)
    with pytest.raises(SystemExit):
        cli.main(["runs", "show", "r1", "--ledger", str(ledger)])
    shown = capsys.readouterr().out
    assert shown.startswith("# Recorded config of run r1 (awrl run)")
    (tmp_path / "again.yaml").write_text(shown)
    again = parse(RunCommand, ["--config", str(tmp_path / "again.yaml")], "awrl run", "").run
    # the same run, as a new one: every run id emptied, all else equal
    assert again == dataclasses.replace(
        RESOLVED, run_id="", rollout=RESOLVED.rollout, train=RESOLVED.train.model_copy(update={"run_id": ""})
    )


# -- one way to find the stack ---------------------------------------------------------------------------


def test_settings_come_from_the_environment_then_dotenv_then_the_local_stack(tmp_path, monkeypatch):
    for name in [k for k in __import__("os").environ if k.startswith("AWRL_")]:
        monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".awrl" / "stack").mkdir(parents=True)
    (tmp_path / ".awrl" / "stack" / "stack.env").write_text(
        "AWRL_KAFKA_BOOTSTRAP=127.0.0.1:1\nAWRL_S3_ENDPOINT=127.0.0.1:2\nAWRL_S3_BUCKET=stack\n"
    )
    assert (StackSettings().kafka_bootstrap, StackSettings().s3_bucket) == ("127.0.0.1:1", "stack")
    (tmp_path / ".env").write_text("AWRL_S3_ENDPOINT=127.0.0.1:3\nAWRL_S3_BUCKET=dotenv\n")
    s = StackSettings()
    assert (s.kafka_bootstrap, s.s3_endpoint, s.s3_bucket) == ("127.0.0.1:1", "127.0.0.1:3", "dotenv")
    monkeypatch.setenv("AWRL_S3_BUCKET", "environment")
    assert StackSettings().s3_bucket == "environment"
    monkeypatch.setenv("AWRL_DATA_DIR", str(tmp_path / "elsewhere"))
    assert StackSettings().kafka_bootstrap == "127.0.0.1:9092"  # that stack.env is not there: the default


# -- users' mistakes -----------------------------------------------------------------------------------------


def _mistakes(ledger: Path, tmp: Path) -> list[tuple[list[str], int, str]]:
    (tmp / "bad.yaml").write_text("train:\n  lrr: 3\n")
    (tmp / "full").mkdir(exist_ok=True)
    (tmp / "full" / "x").write_text("")
    L = ["--ledger", str(ledger)]
    return [
        (["sql", "SELECT 1"], 2, "S3 credentials missing"),  # nothing says where the stack is
        (["runs"], 2, "S3 credentials missing"),
        (["drift", "nosuch", *L], 2, "no run 'nosuch' in the ledger; recent runs: r1"),
        (["report", "nosuch", *L], 2, "no run 'nosuch'"),
        (["replay", "nosuch", *L], 2, "no run 'nosuch'"),
        (["runs", "show", "nosuch", *L], 2, "no run 'nosuch'"),
        (["replay", "r1", "--updates", "3..x", *L], 2, "--updates takes A..B"),
        (["replay", "r1", "--variant", "nope", *L], 2, "unknown variant 'nope'"),
        (["replay", "r1", "--set", "nonsense", *L], 2, "--set takes KEY=VALUE"),
        (["lineage", "r1", "9", *L], 2, "no published version 9"),
        (["sql", "DELETE FROM steps", *L], 2, "refused: only queries"),
        (["sql", "SELECT * FROM nosuch", *L], 2, "nosuch does not exist"),
        (["sql", "SELECT 1", "--format", "xml", *L], 2, "'xml' is not one of"),
        (["sql"], 2, "Missing argument 'query'"),
        (["nosuchverb"], 2, "No such command 'nosuchverb'"),
        (["run", "--config", "missing.yaml"], 2, "--config missing.yaml: no such file"),
        (["run", "--config", str(tmp / "bad.yaml")], 2, "unknown field train.lrr"),
        (["run", "--rollout.suite", "nope"], 2, "invalid choice 'nope'"),
        (["run", "--train.run-id", "x"], 2, "is set by the run: use --run-id"),
        (["train"], 2, "--run-id is required"),
        (["train", "--run-id", "r", "--lr", "-1"], 2, "lr: Input should be greater than 0"),
        (["train", "--run-id", "r", "--nnodes", "2"], 2, "--rdzv-endpoint HOST:PORT is required"),
        (
            ["train", "--run-id", "r", "--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:1"],
            2,
            "--node-rank 2 is outside 0..1",
        ),
        (["eval", "--model-dir", str(tmp / "none")], 2, "not an HF model directory"),
        (["eval", "--models", str(tmp / "none"), str(tmp / "none")], 2, "--models " + str(tmp / "none")),
        (["eval", "--models", str(tmp / "none"), "--labels", "a", "b"], 2, "2 --labels for 1 --models"),
        (["eval", "--labels", "a"], 2, "add --models DIR"),
        (["eval", "--samples", "0"], 2, "samples: must be at least 1"),
        (["rollout", "--suite", "nope"], 2, "invalid choice 'nope'"),
        (["rollout", "--som"], 2, "Unrecognized options: --som"),
        (["rollout", "--max-batch", "0"], 2, "max-batch: must be at least 1"),
        (["sft"], 2, "--run-ids is required"),
        (["sft", "--run-ids", "d", "--lr", "-1"], 2, "lr: Input should be greater than 0"),
        (["stack", "status", "--data-dir", str(tmp / "none")], 1, "no stack running"),
        (["health", "--heartbeat", str(tmp / "none")], 1, "no heartbeat yet"),
        (["view"], 2, "S3 credentials missing"),
        (["view", "--host", "203.0.113.7", *L], 2, "203.0.113.7:8765 cannot be bound"),
        (["export", "tensorboard", "nosuch", *L], 2, "no run 'nosuch'"),
        (["export", "dataset", "r1", "--out", str(tmp / "full"), *L], 2, "is not empty"),
    ]


def test_users_mistakes_end_in_one_line_and_an_exit_code(ledger, tmp_path, monkeypatch, capsys):
    for name in [k for k in __import__("os").environ if k.startswith("AWRL_")]:
        monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)  # no .env, no local stack
    failures = []
    for argv, code, message in _mistakes(ledger, tmp_path):
        with pytest.raises(SystemExit) as exit_:
            cli.main(argv)
        out = capsys.readouterr()
        lines = [line for line in out.err.splitlines() if line.strip()]
        if exit_.value.code != code or len(lines) != 1 or message not in lines[0] or "Traceback" in out.err + out.out:
            failures.append(f"awrl {' '.join(argv)}: exit {exit_.value.code} (want {code}), stderr {out.err!r}")
    assert not failures, "\n".join(failures)
    assert len(_mistakes(ledger, tmp_path)) >= 15


def test_no_broker_is_a_users_mistake_and_other_kafka_timeouts_stay_bugs():
    """kafka-python 3 reports a broker that never answered (`awrl train` with no stack, after ~35 s) as
    a timeout; it is told in one line, while a timeout with a broker up keeps its traceback."""
    from kafka.errors import KafkaTimeoutError

    from app.errors import user_error

    message, code = user_error(KafkaTimeoutError("Unable to bootstrap from [('127.0.0.1', 9092)]"))
    assert code == 2 and message.startswith("no Kafka broker answers at ")
    assert user_error(KafkaTimeoutError("Failed to update metadata after 60.0 secs.")) is None


def test_an_unreachable_store_is_one_line_too(tmp_path):
    env = {
        "PATH": "/usr/bin:/bin",
        "AWRL_S3_ACCESS_KEY": "unused",
        "AWRL_S3_SECRET_KEY": "unused",
        "AWRL_S3_ENDPOINT": "127.0.0.1:1",
    }
    out = subprocess.run(
        [sys.executable, "-m", "app.cli", "sql", "SELECT 1"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.startswith("error: cannot read the ledger at s3://awrl/ledger") and out.stderr.count("\n") == 1


# -- output ----------------------------------------------------------------------------------------------------


def test_machine_output_is_never_wrapped_and_figures_are_rounded_for_people(ledger, tmp_path):
    long = "x" * 300
    env = {"PATH": "/usr/bin:/bin", "COLUMNS": "40"}
    for fmt, check in (
        ("json", lambda o: json.loads(o)[0]["t"] == long),
        ("csv", lambda o: o == f"t\n{long}\n"),
        ("markdown", lambda o: o.splitlines()[2] == f"| {long} |"),
    ):
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "app.cli",
                "sql",
                "SELECT repeat('x', 300) AS t",
                "--format",
                fmt,
                "--ledger",
                str(ledger),
            ],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0 and check(out.stdout), (fmt, out.stdout, out.stderr)
    assert (human(2872.737), human(0.12345), human(12.3456), human(1234567), human(None)) == (
        "2,873",
        "0.123",
        "12.35",
        "1,234,567",
        "-",
    )


def test_version_and_help():
    out = subprocess.run([sys.executable, "-m", "app.cli", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("awrl ")
    out = subprocess.run([sys.executable, "-m", "app.cli", "run", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "--config FILE|NAME" in out.stdout and "--train.grpo.normalizer" in out.stdout
    out = subprocess.run([sys.executable, "-m", "app.cli", "rollout", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "--temperature" in out.stdout and "--curriculum.enabled" in out.stdout
