"""Keeps the run partitions fresh as events arrive, without anyone clicking in the UI, at a cost that
does not grow with how often the ledger writer flushes.

Each tick lists the ledger once (`Ledger.run_fingerprints`: file count, bytes and latest mtime of each
run's files of each event type) and adds unseen runs as `runs` partitions. A run whose files changed is
refreshed, but only:
- the assets downstream of the event types that changed (a rollout-only change leaves `updates` and
  `policy_versions` alone), plus the run's compaction;
- at most once every `REFRESH_EVERY_S` per run: a live run's writer flushes every 0.25 s, so without
  this every tick would recompute it. A change held back stays pending in the cursor (which keeps the
  fingerprints as of the last refresh), so the run's final state is always materialized.
The `run_key` carries the fingerprints, so a tick that is retried never launches the same refresh twice.
"""

import hashlib
import json
import time

import dagster as dg

from analysis.views import RAW_VIEWS
from assets.io import Ledger
from assets.partitions import runs

REFRESH_EVERY_S = 120.0
"""Least time between two refreshes of one run. The UI lags a live run by at most this (plus a tick);
a run that stopped writing is refreshed at the first tick after it."""
TICK_S = 30
"""Least time between two sensor ticks."""
VIEW_OF = {cls.__name__: view for view, cls in RAW_VIEWS.items()}
"""Event type (directory name in the ledger) -> its external asset (`assets.events`)."""


def stale_assets(graph, changed_types: list[str]) -> list[dg.AssetKey]:
    """The materializable assets that read (directly or not) the changed event types, plus compaction;
    never `replay`, which a person launches."""
    events = [dg.AssetKey(VIEW_OF[t]) for t in changed_types if t in VIEW_OF]
    downstream = dg.AssetSelection.assets(*events).downstream().resolve(graph) if events else set()
    keep = {k for k in downstream if graph.get(k).is_materializable} - {dg.AssetKey("replay")}
    return sorted(keep | {dg.AssetKey("compaction")}, key=lambda k: k.to_user_string())


@dg.sensor(
    target=dg.AssetSelection.all() - dg.AssetSelection.assets("replay"),  # replay: launched by a person
    minimum_interval_seconds=TICK_S,
    default_status=dg.DefaultSensorStatus.RUNNING,
)
def ledger_sensor(context: dg.SensorEvaluationContext, ledger: Ledger) -> dg.SensorResult:
    """Add new runs as partitions; refresh what changed in each run, at most every `REFRESH_EVERY_S`."""
    cursor: dict = json.loads(context.cursor) if context.cursor else {}
    now, clock = ledger.run_fingerprints(), time.time()
    known = set(context.instance.get_dynamic_partitions(runs.name))
    new = [run for run in now if run not in known]
    requests = []
    for run, types in now.items():
        before = cursor.get(run)
        if not isinstance(before, dict):  # unseen, or a cursor from before per-type fingerprints
            before = {"types": {}, "at": 0.0}
        changed = [t for t, fp in types.items() if before["types"].get(t) != fp]
        if not changed or clock - before["at"] < REFRESH_EVERY_S:
            continue
        digest = hashlib.sha256(json.dumps(types, sort_keys=True).encode()).hexdigest()[:16]
        requests.append(
            dg.RunRequest(
                partition_key=run,
                run_key=f"{run}@{digest}",
                asset_selection=stale_assets(context.repository_def.asset_graph, changed),
            )
        )
        cursor[run] = {"types": types, "at": clock}
    return dg.SensorResult(
        run_requests=requests,
        dynamic_partitions_requests=[runs.build_add_request(new)] if new else [],
        cursor=json.dumps(cursor),
    )
