"""Derived per-row columns the ledger stores beside an event's own fields, so that frequent analyses read
a few integers instead of decoding arrays. They are not part of the event (readers of events ignore
them: `read_events` projects to the event schema) and files written before they existed lack them
(`analysis.views` reads those the old way).

StepRecorded: `token_policy_versions` summarised per step, for the drift report's token pass (1M steps
x ~240 tokens: the arrays cost ~2.4 s to decode, the summaries a few milliseconds).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

TOKEN_SUMMARY = pa.schema(
    [
        ("response_tokens", pa.int64()),
        ("token_version_min", pa.int64()),
        ("token_version_max", pa.int64()),
        ("token_version_sum", pa.int64()),
    ]
)
"""Response tokens of the step, and the min / max / sum of their policy versions (null without tokens)."""


def with_summaries(event_type: str, table: pa.Table) -> pa.Table:
    """`table` with its type's derived columns (recomputed if present; unchanged for other types)."""
    if event_type != "StepRecorded":
        return table
    table = table.drop_columns([c for c in TOKEN_SUMMARY.names if c in table.column_names])
    versions = table.column("token_policy_versions").combine_chunks()
    n = len(versions)
    counts = pc.list_value_length(versions).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    stats = (
        pa.table({"row": pc.list_parent_indices(versions), "v": pc.list_flatten(versions)})
        .group_by("row")
        .aggregate([("v", "min"), ("v", "max"), ("v", "sum")])
    )
    rows = stats.column("row").to_numpy()
    has = np.zeros(n, dtype=bool)
    has[rows] = True

    def scatter(column: str) -> pa.Array:
        out = np.zeros(n, dtype=np.int64)
        out[rows] = stats.column(column).to_numpy()
        return pa.array(out, mask=~has)

    columns = [pa.array(counts), scatter("v_min"), scatter("v_max"), scatter("v_sum")]
    for field, column in zip(TOKEN_SUMMARY, columns):
        table = table.append_column(field, column)
    return table
