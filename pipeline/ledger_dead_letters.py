"""The ledger's copy of the messages its consumers refused (`_dead_letters/`): the dead-letter topic is
in memory too on the local stack."""

from __future__ import annotations

from datetime import UTC, datetime

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.fs as pafs

from pipeline.consumer import Rejected
from pipeline.s3 import ledger_filesystem
from pipeline.settings import StackSettings

DEAD_LETTERS = "_dead_letters"


def dead_letter_table(rejected: list[Rejected]) -> pa.Table:
    """The ledger's copy of dead-lettered messages, one row each (`read_dead_letters` reads them)."""
    now = datetime.now(UTC)
    return pa.table(
        {
            "dead_letter_id": pa.array([r.dead_letter_id for r in rejected], pa.string()),
            "reason": pa.array([r.reason for r in rejected], pa.string()),
            "source_topic": pa.array([r.source_topic for r in rejected], pa.string()),
            "source_partition": pa.array([r.source_partition for r in rejected], pa.int32()),
            "source_offset": pa.array([r.source_offset for r in rejected], pa.int64()),
            "key": pa.array([r.key for r in rejected], pa.binary()),
            "value": pa.array([r.value for r in rejected], pa.binary()),
            "dead_lettered_at": pa.array([now] * len(rejected), pa.timestamp("us", tz="UTC")),
        }
    )


def read_dead_letters(settings: StackSettings) -> pa.Table:
    """Every dead letter the ledger holds, once each (a crash before a commit dead-letters a message
    again: same id)."""
    fs, root = ledger_filesystem(settings, create=False)
    infos = fs.get_file_info(pafs.FileSelector(f"{root}/{DEAD_LETTERS}", allow_not_found=True))
    files = sorted(i.path for i in infos if i.type == pafs.FileType.File and i.path.endswith(".parquet"))
    if not files:
        return dead_letter_table([])
    table = ds.dataset(files, filesystem=fs, format="parquet").to_table()
    first = {}
    for i, dead_letter_id in enumerate(table.column("dead_letter_id").to_pylist()):
        first.setdefault(dead_letter_id, i)
    return table.take(sorted(first.values()))
