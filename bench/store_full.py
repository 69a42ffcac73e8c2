"""A local store emptied and refilled: is a deleted object's space given back in time?

    .venv/bin/python bench/store_full.py [--rounds 3] [--objects 40] [--pause 5]

One fresh local stack (memstore, 4 GiB). Each round stores `objects` objects of 64 MiB (2.5 GiB at
40) in a bucket of its own, then removes the bucket and waits `pause` seconds. Without garbage
collection of deleted data, the second round fills the cluster and its writes are held (each then
fails after `pipeline.s3.STORE_READ_TIMEOUT_S`). Prints a line a round.
"""

from __future__ import annotations

import io
import os
import time

import typer
from rich.console import Console

from stack import local_stack

console = Console()


def main(rounds: int = 3, objects: int = 40, pause: float = 5.0) -> None:
    from pipeline.s3 import minio_client, remove_bucket
    from pipeline.store import ScreenshotStore

    blob = os.urandom(64 << 20)
    with local_stack() as (stack, _, _):
        for r in range(rounds):
            settings = stack.settings().model_copy(update={"s3_bucket": f"awrl-fill-{r}"})
            ScreenshotStore.from_settings(settings).ensure_bucket()
            client, t0 = minio_client(settings), time.monotonic()
            for i in range(objects):
                try:
                    client.put_object(
                        settings.s3_bucket,
                        f"fill/{i}",
                        io.BytesIO(blob[:-1] + bytes([i])),
                        len(blob),
                        part_size=16 << 20,
                    )
                except Exception as exc:  # noqa: BLE001 - the finding is which write failed and how
                    console.print(
                        f"round {r}: object {i} of {objects} failed after "
                        f"{time.monotonic() - t0:.0f} s: {type(exc).__name__}"
                    )
                    raise typer.Exit(1) from None
            console.print(f"round {r}: {objects} x 64 MiB stored in {time.monotonic() - t0:.0f} s")
            remove_bucket(settings)
            time.sleep(pause)


if __name__ == "__main__":
    typer.run(main)
