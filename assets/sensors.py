"""Keeps the run partitions fresh as events arrive, without anyone clicking in the UI.

Each tick lists the ledger once (`Ledger.run_fingerprints`: file count, bytes and latest mtime of each
`run_id=*` directory), adds unseen runs as `runs` partitions, and requests a materialization of every
run whose fingerprint differs from the one stored in the cursor. The `run_key` carries the fingerprint,
so a tick that is retried never launches the same refresh twice.
"""

import json

import dagster as dg

from assets.io import Ledger
from assets.partitions import runs


@dg.sensor(
    target=dg.AssetSelection.all() - dg.AssetSelection.assets("replay"),  # replay: launched by a person
    minimum_interval_seconds=30,
    default_status=dg.DefaultSensorStatus.RUNNING,
)
def ledger_sensor(context: dg.SensorEvaluationContext, ledger: Ledger) -> dg.SensorResult:
    """Add new runs as partitions; re-materialize runs whose event files changed since the last tick."""
    before: dict[str, str] = json.loads(context.cursor) if context.cursor else {}
    now = ledger.run_fingerprints()
    known = set(context.instance.get_dynamic_partitions(runs.name))
    new = [run for run in now if run not in known]
    changed = [run for run, fp in now.items() if before.get(run) != fp]
    return dg.SensorResult(
        run_requests=[dg.RunRequest(partition_key=run, run_key=f"{run}@{now[run]}") for run in changed],
        dynamic_partitions_requests=[runs.build_add_request(new)] if new else [],
        cursor=json.dumps(now),
    )
