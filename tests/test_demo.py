"""Smoke tests of the entry points. `make demo` itself runs in tests/test_readme.py, as the README's
first step, with a small budget."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pipeline.stack.local import LocalStack
from pipeline.store import ScreenshotStore


def test_every_verb_has_help():
    import typer
    from typer.testing import CliRunner

    from app.cli import app

    top = subprocess.run([sys.executable, "-m", "app.cli", "--help"], capture_output=True, text=True)
    assert top.returncode == 0
    root = typer.main.get_command(app)
    verbs = [
        [name, *([sub] if sub else [])]
        for name, cmd in root.commands.items()
        for sub in [None, *getattr(cmd, "commands", {})]
    ]
    assert len(verbs) >= 20
    for verb in verbs:
        out = CliRunner().invoke(app, [*verb, "--help"])
        assert out.exit_code == 0 and "usage" in out.output.lower(), (verb, out.output)


@pytest.mark.slow
def test_durable_store_survives_a_stack_restart(tmp_path):
    stack = LocalStack.up(tmp_path, durable=True)
    try:
        digest = ScreenshotStore.from_settings(stack.settings()).put(b"\x89PNG survives restart")
        creds = stack.s3
    finally:
        stack.down()
    stack = LocalStack.up(tmp_path, durable=True)
    try:
        assert stack.s3.access_key == creds.access_key
        assert ScreenshotStore.from_settings(stack.settings()).get(digest) == b"\x89PNG survives restart"
    finally:
        stack.down()
