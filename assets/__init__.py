"""Dagster definitions over the Parquet ledger (ledger issue)."""
