"""The linter (`pyproject.toml`'s `[tool.ruff]`, `make lint`): `ruff check .` passes on the whole tree."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUFF = Path(sys.executable).with_name("ruff")  # the venv's, pinned by the `test` extra


def test_the_tree_passes_ruff():
    result = subprocess.run([str(RUFF), "check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
