"""Ledger upkeep as an asset: compaction of a run's small event files (`pipeline.compaction`).

Materialised with the tables (the sensor requests every asset of a run whose files changed), so a live
run's thousands of one-flush files are merged into large sorted ones while it runs. A pass leaves
files younger than a minute and the writer's journaled files alone, and deletes superseded files a
minute after the switch, so queries running meanwhile still see every row once.
"""

import dagster as dg

from assets.io import Ledger
from assets.tables import runs
from pipeline.ledger import compact_ledger


@dg.asset(partitions_def=runs)
def compaction(context: dg.AssetExecutionContext, ledger: Ledger) -> dg.MaterializeResult:
    """One compaction pass over the run's event files: files before and after, rows merged."""
    results = compact_ledger(ledger.settings(), context.partition_key)
    return dg.MaterializeResult(metadata={
        "files_before": sum(r.files_before for r in results.values()),
        "files_after": sum(r.files_after for r in results.values()),
        "rows_merged": sum(r.rows for r in results.values()),
        "files_deleted": sum(r.deleted for r in results.values()),
    })
