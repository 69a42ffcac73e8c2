"""Dagster definitions over the Parquet ledger: `dagster dev` in the repo root (or `-m assets`) loads `defs`.

The ledger location comes from `StackSettings` (env `AWRL_*` or `.env`), the same as every other
component, so the UI shows the run the stack is writing without further configuration. Runs use the
in-process executor: each asset is a small fold over one run's files, and a subprocess per asset (the
default) costs more in Python start-up than the work itself.
"""

from __future__ import annotations

import dagster as dg

from assets import checks, judging, maintenance, replay, tables
from assets.events import event_tables
from assets.io import Ledger, ParquetIOManager
from assets.sensors import ledger_sensor

ledger = Ledger()
all_assets = dg.load_assets_from_modules([tables, maintenance, judging])
"""What Dagster materializes; `event_tables` above them are the ledger writer's."""
all_checks = dg.load_asset_checks_from_modules([checks, judging])
"""The checks that guard them (`assets.checks`), run with each materialization."""
replay_assets = [replay.replay, replay.replay_bit_exact]
"""Replay through a loss variant, launched by a person (`assets.replay`); the sensor leaves it alone."""

defs = dg.Definitions(
    assets=[*event_tables, *all_assets, replay.replay],
    asset_checks=[*all_checks, replay.replay_bit_exact],
    sensors=[ledger_sensor],
    executor=dg.in_process_executor,
    resources={"ledger": ledger, "io_manager": ParquetIOManager(ledger=ledger)},
)
