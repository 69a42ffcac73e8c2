"""Where the assets read events from and write tables to: the Parquet ledger (local directory or S3).

`Ledger` reads the raw event files the ledger writer produced; `ParquetIOManager` stores each asset
partition beside them under `<ledger root>/assets/<asset>/run_id=<run>/data.parquet`, so DuckDB and any
other reader find the derived tables with the same filesystem and credentials as the events.

No `from __future__ import annotations` here: Dagster reads the context and resource annotations
at definition time and rejects them as strings.
"""

import io

import dagster as dg
import duckdb
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from pipeline.files import write_atomic
from pipeline.ledger import ledger_filesystem, read_events
from pipeline.s3 import minio_client
from pipeline.settings import StackSettings


class Ledger(dg.ConfigurableResource):
    """The event ledger of `StackSettings` (env `AWRL_*` / `.env`), optionally at another root."""

    ledger_uri: str | None = None
    """Override of `AWRL_LEDGER_URI` (tests point it at a temporary directory)."""

    def settings(self) -> StackSettings:
        s = StackSettings()
        return s.model_copy(update={"ledger_uri": self.ledger_uri}) if self.ledger_uri else s

    def filesystem(self) -> tuple[pafs.FileSystem, str]:
        return ledger_filesystem(self.settings())

    def events(self, run_id: str, event_type: str, columns: list[str] | None = None) -> pa.Table:
        """All events of one type in one run (`pipeline.ledger.read_events`)."""
        return read_events(self.settings(), run_id, event_type, columns)

    def run_fingerprints(self) -> dict[str, dict[str, str]]:
        """`{run_id: {event_type: "<files>-<bytes>-<latest mtime>"}}` over the event files (one listing).

        Ledger files are immutable and only ever added (compaction swaps many for one), so a
        fingerprint changes exactly when that event type's files of that run changed.
        """
        fs, root = self.filesystem()
        acc: dict[str, dict[str, list[int]]] = {}
        for info in fs.get_file_info(pafs.FileSelector(root, recursive=True, allow_not_found=True)):
            parts = info.path[len(root) :].lstrip("/").split("/")
            if (
                info.type != pafs.FileType.File
                or len(parts) < 3
                or not parts[0].startswith("run_id=")
                or not parts[1].startswith("event_type=")
                or not info.path.endswith(".parquet")
            ):
                continue
            run, event_type = parts[0].removeprefix("run_id="), parts[1].removeprefix("event_type=")
            a = acc.setdefault(run, {}).setdefault(event_type, [0, 0, 0])
            a[0], a[1], a[2] = a[0] + 1, a[1] + (info.size or 0), max(a[2], info.mtime_ns or 0)
        return {run: {t: "-".join(map(str, a)) for t, a in sorted(types.items())} for run, types in sorted(acc.items())}


def run_query(query: str, **tables: pa.Table) -> pa.Table:
    """Run DuckDB SQL over in-memory Arrow tables (each keyword becomes a view of that name)."""
    con = duckdb.connect()
    con.execute("SET TimeZone = 'UTC'")  # timestamps keep the ledger's `UTC` zone, not `Etc/UTC`
    for name, table in tables.items():
        con.register(name, table)
    return con.sql(query).to_arrow_table()


class ParquetIOManager(dg.ConfigurableIOManager):
    """One Parquet file per asset partition, written whole (a reader never sees half a file)."""

    ledger: Ledger

    def _path(self, context: dg.OutputContext | dg.InputContext) -> str:
        _, root = self.ledger.filesystem()
        run = f"run_id={context.asset_partition_key}" if context.has_asset_partitions else "all"
        return f"{root}/assets/{'/'.join(context.asset_key.path)}/{run}/data.parquet"

    def handle_output(self, context: dg.OutputContext, table: pa.Table) -> None:
        buf = io.BytesIO()
        pq.write_table(table, buf, compression="zstd")
        data, path = buf.getvalue(), self._path(context)
        fs, _ = self.ledger.filesystem()
        if isinstance(fs, pafs.LocalFileSystem):
            write_atomic(path, data)
        else:  # one PUT with a length: pyarrow's multipart writer gets HTTP 411 from radosgw
            bucket, key = path.split("/", 1)
            minio_client(self.ledger.settings()).put_object(bucket, key, io.BytesIO(data), len(data))
        context.add_output_metadata({"path": dg.MetadataValue.path(path), "bytes": len(data)})

    def load_input(self, context: dg.InputContext) -> pa.Table:
        fs, _ = self.ledger.filesystem()
        return pq.read_table(self._path(context), filesystem=fs)
