"""The raw event tables as external assets: the top of the graph.

The ledger writer, not Dagster, produces them (one Parquet directory per event type and run), so each
is an `AssetSpec`: Dagster shows it, its columns and what reads it, and never tries to materialize it.
The columns are the event's Arrow schema (`schemas.arrow_schema`), the one the writer writes.
"""

import dagster as dg
import pyarrow as pa

from analysis.views import RAW_VIEWS
from assets.partitions import runs


def table_schema(schema: pa.Schema) -> dg.TableSchema:
    """Dagster's column schema of an Arrow schema (shown in the asset's Columns tab)."""
    return dg.TableSchema(columns=[dg.TableColumn(f.name, str(f.type)) for f in schema])


def _spec(view: str, cls) -> dg.AssetSpec:
    from schemas import arrow_schema

    return dg.AssetSpec(
        key=view,
        group_name="events",
        kinds={"parquet", "kafka"},
        partitions_def=runs,
        description=f"`{cls.__name__}` events as the ledger writer stored them (DuckDB view `{view}`). "
        + (cls.__doc__ or "").strip().split("\n\n")[0],
        metadata={"dagster/column_schema": table_schema(arrow_schema(cls)), "event_type": cls.__name__},
    )


event_tables = [_spec(view, cls) for view, cls in RAW_VIEWS.items()]
"""One external asset per event type, named as its raw DuckDB view (`StepRecorded` -> `step_recorded`)."""
