"""The import contract (`pyproject.toml`, `lint-imports`): one-way layers and no cycles, on the real tree
and, as proof that it can fail, on a copy with an upward import planted in the infrastructure."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("schemas", "pipeline", "model", "rollout", "trainer", "analysis", "assets", "app")
LINT = Path(sys.executable).with_name("lint-imports")


def _lint(root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root)}  # the tree under test shadows the installed one
    return subprocess.run(
        [str(LINT), "--no-cache", "--config", str(root / "pyproject.toml")],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _copy(tmp_path: Path) -> Path:
    for name in PACKAGES:
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def test_the_tree_keeps_the_import_contract():
    result = _lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 kept, 0 broken" in result.stdout


@pytest.mark.parametrize(
    ("module", "planted", "broken"),
    [
        ("pipeline/bus.py", "import app.demo", "One-way layers"),  # infrastructure reaching up to the application
        ("rollout/dispatcher.py", "from trainer.staleness import StalenessBudget", "One-way layers"),  # sideways
        ("trainer/losses/__init__.py", "import trainer.config", "No import cycles"),  # config imports losses
    ],
)
def test_a_planted_upward_or_circular_import_breaks_the_contract(tmp_path, module, planted, broken):
    root = _copy(tmp_path)
    target = root / module
    target.write_text(target.read_text() + f"\n{planted}  # planted\n")
    result = _lint(root)
    assert result.returncode != 0
    assert f"{broken}" in result.stdout and "BROKEN" in result.stdout
    assert module.split("/")[0] in result.stdout
