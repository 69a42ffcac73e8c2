"""Ledger upkeep as an asset: compaction of a run's small event files (`pipeline.compaction`).

Materialised with the tables (the sensor requests every asset of a run whose files changed), so a live
run's thousands of one-flush files are merged into large sorted ones while it runs. A pass leaves
files younger than a minute and the writer's journaled files alone, and deletes superseded files a
minute after the switch, so queries running meanwhile still see every row once.

Passes that overlap (two sensor runs, or `awrl ledger compact` beside Dagster) leave every row once:
a pass whose files another pass claimed gives way (`pipeline.compaction`). The pool `ledger_compaction` (limit 1 in
`dagster.yaml`) keeps Dagster's own passes from overlapping, so none wastes its work.
"""

import dagster as dg
import pyarrow as pa

from assets.io import Ledger
from assets.partitions import runs
from pipeline.ledger import compact_ledger

POOL = "ledger_compaction"


@dg.asset(partitions_def=runs, pool=POOL, group_name="events", kinds={"parquet"})
def compaction(context: dg.AssetExecutionContext, ledger: Ledger) -> dg.Output[pa.Table]:
    """One compaction pass over the run's event files: per event type, files before and after, rows
    merged and superseded files deleted."""
    results = compact_ledger(ledger.settings(), context.partition_key)
    table = pa.Table.from_pylist(
        [
            {
                "event_type": t,
                "files_before": r.files_before,
                "files_after": r.files_after,
                "rows_merged": r.rows,
                "files_deleted": r.deleted,
            }
            for t, r in sorted(results.items())
        ],
        schema=pa.schema(
            [
                ("event_type", pa.string()),
                ("files_before", pa.int64()),
                ("files_after", pa.int64()),
                ("rows_merged", pa.int64()),
                ("files_deleted", pa.int64()),
            ]
        ),
    )
    return dg.Output(
        table,
        metadata={
            "dagster/row_count": table.num_rows,
            "files_before": sum(r.files_before for r in results.values()),
            "files_after": sum(r.files_after for r in results.values()),
            "rows_merged": sum(r.rows for r in results.values()),
            "passes_yielded": sum(r.yielded for r in results.values()),
        },
    )
