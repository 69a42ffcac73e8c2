"""What the viewer draws: verified screenshots (cached by hash), a step's marks and click on its
screenshot, a run's curves by policy version, and the replay asset's row for an update."""

from __future__ import annotations

import io
import threading
from collections import OrderedDict

import pyarrow.parquet as pq
from PIL import Image, ImageDraw

from pipeline.ledger import ledger_filesystem
from pipeline.s3 import StoreUnavailable
from pipeline.settings import StackSettings
from pipeline.store import ScreenshotCorrupted, ScreenshotMissing, ScreenshotStore
from rollout.som import draw_marks
from schemas.observation import Mark

CACHE_BYTES = 256 << 20
"""Verified screenshots kept in memory (~1-3k PNGs): a trajectory page and its images read each twice."""


class Screenshots:
    """The store's screenshots by hash, verified, the most recently used kept in memory. A hash that
    is missing or corrupt is a problem string (`"screenshot missing: ..."`), not an exception."""

    def __init__(self, settings: StackSettings, patience_s: float = 5.0):
        self.settings, self.patience_s = settings, patience_s
        self._store: ScreenshotStore | None = None
        self._cache: OrderedDict[str, bytes] = OrderedDict()
        self._size = 0
        self._lock = threading.Lock()

    def get(self, sha: str) -> tuple[bytes | None, str | None]:
        with self._lock:
            if sha in self._cache:
                self._cache.move_to_end(sha)
                return self._cache[sha], None
        try:
            if self._store is None:
                self._store = ScreenshotStore.from_settings(self.settings, patience_s=self.patience_s)
            data = self._store.get(sha)
        except ScreenshotMissing:
            return None, f"screenshot missing: no object for {sha[:12]} in the store"
        except ScreenshotCorrupted:
            return None, f"screenshot corrupt: the object stored for {sha[:12]} does not hash to it"
        except (StoreUnavailable, OSError) as exc:
            return None, f"screenshot unavailable: the store did not answer ({type(exc).__name__})"
        with self._lock:
            self._cache[sha] = data
            self._size += len(data)
            while self._size > CACHE_BYTES and len(self._cache) > 1:
                self._size -= len(self._cache.popitem(last=False)[1])
        return data, None

    def problem(self, sha: str) -> str | None:
        return self.get(sha)[1]


def drawn_step(png: bytes, step: dict) -> bytes:
    """The screenshot with the step's Set-of-Mark boxes (unless already drawn on it) and where it acted
    (a click, or typing into a field): a ring at (x, y), or at the centre of the mark it named."""
    marks = [Mark(**m) for m in step["marks"] or []]
    if marks and not step["marks_drawn"]:
        png = draw_marks(png, marks)
    action = step["action"] or {}
    at = (
        (action["x"], action["y"])
        if action.get("x") is not None
        else next((m.center for m in marks if m.id == action.get("mark")), None)
    )
    if at is None:
        return png
    img = Image.open(io.BytesIO(png)).convert("RGB")
    x, y = at
    ImageDraw.Draw(img).ellipse([x - 12, y - 12, x + 12, y + 12], outline=(20, 110, 240), width=4)
    out = io.BytesIO()
    img.save(out, format="PNG", compress_level=1)
    return out.getvalue()


def curves_svg(series: dict[str, list[tuple[float, float]]], run_id: str) -> bytes:
    """Small multiples, one per series, against policy version (matplotlib, SVG)."""
    from analysis.plotting import plt  # here: matplotlib takes a second to load, and only this view needs it

    names = list(series)
    cols = 4
    fig, axes = plt.subplots(
        (len(names) + cols - 1) // cols, cols, figsize=(13, 2.3 * ((len(names) + 3) // 4)), squeeze=False
    )
    for ax, name in zip(axes.flat, names):
        points = series[name]
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", markersize=3, lw=1.2)
        else:
            ax.text(0.5, 0.5, "not recorded", ha="center", va="center", transform=ax.transAxes, color="grey")
        ax.set_title(name, fontsize=9)
        ax.tick_params(labelsize=7)
        ax.set_xlabel("policy version", fontsize=7)
    for ax in list(axes.flat)[len(names) :]:
        ax.set_visible(False)
    fig.suptitle(run_id, fontsize=9)
    fig.tight_layout()
    out = io.BytesIO()
    fig.savefig(out, format="svg")
    plt.close(fig)
    return out.getvalue()


def replay_rows(settings: StackSettings, run_id: str, update_step: int) -> dict | None:
    """The `replay` asset's row for this update (bit-exact or not, the variant beside it), if the asset
    was materialized for the run; else None."""
    fs, root = ledger_filesystem(settings, create=False)
    path = f"{root}/assets/replay/run_id={run_id}/data.parquet"
    try:
        table = pq.read_table(path, filesystem=fs)
    except (FileNotFoundError, OSError):
        return None
    found = [r for r in table.to_pylist() if r["update_step"] == update_step]
    return found[0] if found else None
