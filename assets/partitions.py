"""The partitions every asset shares: one per training run."""

import dagster as dg

runs = dg.DynamicPartitionsDefinition(name="runs")
"""One partition per `run_id` found in the ledger (added by `assets.sensors.ledger_sensor`)."""
