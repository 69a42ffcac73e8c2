"""How long a verb takes to answer before it does any work: `--help` of each kind of verb, side by side.

    .venv/bin/python bench/cli_startup.py [--reps 5]

Runs `awrl --help` (the baseline), `awrl sql --help` (a typer verb) and `awrl run --help` (a verb whose
flags tyro derives from the config objects) in turn, `reps` times each, and prints each one's median
wall time and its ratio to the baseline, measured pair by pair (the machine's speed drifts).
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

import typer

AWRL = str(Path(sys.executable).with_name("awrl"))
VERBS = {
    "awrl --help": [AWRL, "--help"],
    "awrl sql --help": [AWRL, "sql", "--help"],
    "awrl run --help": [AWRL, "run", "--help"],
}


def _wall(argv: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    return time.perf_counter() - t0


def main(reps: int = 5) -> None:
    _wall(VERBS["awrl run --help"])  # warm the page cache
    times: dict[str, list[float]] = {name: [] for name in VERBS}
    for _ in range(reps):
        for name, argv in VERBS.items():
            times[name].append(_wall(argv))
    base = times["awrl --help"]
    print(f"{'command':<18} {'median s':>9} {'x awrl --help':>14}")
    for name, walls in times.items():
        ratio = statistics.median(w / b for w, b in zip(walls, base))
        print(f"{name:<18} {statistics.median(walls):>9.2f} {ratio:>14.2f}")


if __name__ == "__main__":
    typer.run(main)
