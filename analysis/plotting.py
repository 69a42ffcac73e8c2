"""matplotlib for every picture drawn here: pyplot on the Agg backend (headless, no display needed),
and the one way a figure is written to a file.

    from analysis.plotting import plt, save
    fig, ax = plt.subplots()
    save(fig, Path("out/plot.png"))
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after `use`: the backend must be chosen before pyplot loads


def save(fig, path: Path, dpi: int = 110) -> Path:
    """Lay out `fig`, write it to `path` (its folder made if need be) and close it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


__all__ = ["plt", "save"]
