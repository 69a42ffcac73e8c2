"""The embedded local stack: Tansu (Kafka protocol) + Ceph radosgw (S3) on 127.0.0.1, on free ports,
and optionally the vLLM policy server (`pipeline.stack.vllm`).

`up` records what it started in `<data_dir>/stack.json` and writes the connection settings to
`<data_dir>/stack.env` (mode 0600, the same variables docker-compose's `.env` uses). `down` stops
exactly the PIDs in that record. The pytest fixture and `awrl stack up` both go through this class.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import tenacity

from pipeline.bus import create_topics
from pipeline.files import write_atomic
from pipeline.settings import StackSettings
from pipeline.stack.ceph import S3Credentials, s3_healthy, start_ceph_s3
from pipeline.stack.process import ServiceProc, StackError, pid_alive, port_open, respawn, stop, wait_until
from pipeline.stack.tansu import start_tansu
from pipeline.stack.vllm import VLLM_STARTUP_S, VLLMServerConfig, start_vllm, vllm_healthy
from pipeline.store import ScreenshotStore

STATE_FILE = "stack.json"
ENV_FILE = "stack.env"
DOTENV_MARKER = "# written by `awrl stack up`; remove this line to keep your edits"


@dataclass
class LocalStack:
    data_dir: Path
    services: list[ServiceProc] = field(default_factory=list)
    kafka_bootstrap: str = ""
    s3: S3Credentials | None = None
    durable: bool = True
    bucket: str = "awrl"
    vllm_model: str = ""

    # -- lifecycle -------------------------------------------------------------------------------
    @classmethod
    def up(
        cls,
        data_dir: Path,
        durable: bool = True,
        kafka_port: int | None = None,
        s3_port: int | None = None,
        bucket: str = "awrl",
        vllm: VLLMServerConfig | None = None,
    ) -> LocalStack:
        """Start the stack, or return the one already running from `data_dir`. `vllm`: also run the
        policy server (added to a running stack that has none)."""
        data_dir = Path(data_dir).resolve()
        data_dir.mkdir(parents=True, exist_ok=True)
        running = cls.load(data_dir)
        if running is not None and running.healthy():
            if vllm is not None and not running.vllm_url:
                running.add_vllm(vllm)
            return running
        if running is not None:  # half-dead from a crash: clear it before starting anew
            running.down()
        stack = cls(data_dir=data_dir, durable=durable, bucket=bucket)
        try:
            kafka = start_tansu(data_dir, port=kafka_port)
            stack.services.append(kafka)
            stack.kafka_bootstrap = f"127.0.0.1:{kafka.port}"
            stack.s3, ceph = start_ceph_s3(data_dir / "ceph", durable=durable, rgw_port=s3_port)
            stack.services.extend(ceph)
            stack._save()
            stack._bootstrap()
            if vllm is not None:
                stack.add_vllm(vllm)
        except BaseException:
            stack.down()
            raise
        return stack

    def add_vllm(self, config: VLLMServerConfig, port: int | None = None) -> None:
        """Start the policy server beside the running services and record it."""
        proc = start_vllm(self.data_dir, config, port=port)
        self.services.append(proc)
        self.vllm_model = config.served_model_name
        self._save()

    def _bootstrap(self) -> None:
        settings = self.settings()
        create_topics(settings)
        ScreenshotStore.from_settings(settings).ensure_bucket()

    def down(self) -> None:
        """Stop every PID we started (reverse start order), then forget them."""
        for proc in reversed(self.services):
            stop(proc)
        self.services = []
        (self.data_dir / STATE_FILE).unlink(missing_ok=True)

    def restart(self, name: str, downtime_s: float = 0.0, crash: bool = False) -> None:
        """Stop one service (`crash`: SIGKILL, no goodbye), leave it down for `downtime_s`, start it
        again on the same port.

        The fault tests' handle on the stack. Tansu keeps its log in memory, so a restarted broker
        comes back empty: the default topics are created again, as `up` does."""
        i = next((i for i, s in enumerate(self.services) if s.name == name), None)
        if i is None:
            raise KeyError(f"no service {name!r} in this stack (have: {[s.name for s in self.services]})")
        old = self.services[i]
        if crash and pid_alive(old):
            os.kill(old.pid, signal.SIGKILL)
        stop(old)
        time.sleep(downtime_s)
        # Right after a SIGKILL the dead broker's connections can hold the port for a moment.
        for attempt in tenacity.Retrying(
            retry=tenacity.retry_if_exception_type(StackError),
            wait=tenacity.wait_fixed(0.5),
            stop=tenacity.stop_after_delay(30),
            reraise=True,
        ):
            with attempt:
                self.services[i] = (
                    start_tansu(self.data_dir, port=old.port)
                    if name == "kafka"
                    else respawn(old, timeout=VLLM_STARTUP_S if name == "vllm" else 60.0)
                )
        if name == "s3" and self.s3 is not None:
            wait_until(lambda: s3_healthy(self.s3), "radosgw HTTP", 60, self.services[i])
        if name == "vllm":
            wait_until(lambda: vllm_healthy(old.port), "vllm", VLLM_STARTUP_S, self.services[i])
        self._save()
        if name == "kafka":
            self._bootstrap()

    # -- state -----------------------------------------------------------------------------------
    @classmethod
    def load(cls, data_dir: Path) -> LocalStack | None:
        path = Path(data_dir).resolve() / STATE_FILE
        if not path.exists():
            return None
        raw = json.loads(path.read_text())
        return cls(
            data_dir=Path(raw["data_dir"]),
            services=[ServiceProc(**s) for s in raw["services"]],
            kafka_bootstrap=raw["kafka_bootstrap"],
            s3=S3Credentials(**raw["s3"]) if raw.get("s3") else None,
            durable=raw["durable"],
            bucket=raw["bucket"],
            vllm_model=raw.get("vllm_model", ""),
        )

    def _save(self) -> None:
        state = {
            "data_dir": str(self.data_dir),
            "services": [s.to_dict() for s in self.services],
            "kafka_bootstrap": self.kafka_bootstrap,
            "s3": vars(self.s3) if self.s3 else None,
            "durable": self.durable,
            "bucket": self.bucket,
            "vllm_model": self.vllm_model,
        }
        _write_private(self.data_dir / STATE_FILE, json.dumps(state, indent=2))
        _write_private(self.data_dir / ENV_FILE, self.dotenv())

    # -- views -----------------------------------------------------------------------------------
    @property
    def vllm_url(self) -> str:
        """The policy server's OpenAI base URL; "" when the stack runs none."""
        return next((f"http://127.0.0.1:{s.port}/v1" for s in self.services if s.name == "vllm"), "")

    def settings(self) -> StackSettings:
        assert self.s3 is not None, "stack has no S3 service"
        return StackSettings(
            kafka_bootstrap=self.kafka_bootstrap,
            s3_endpoint=self.s3.endpoint,
            s3_access_key=self.s3.access_key,
            s3_secret_key=self.s3.secret_key,
            s3_bucket=self.bucket,
            ledger_uri=f"s3://{self.bucket}/ledger",
            vllm_url=self.vllm_url or None,
            vllm_model=self.vllm_model or "policy",
            outbox_dir=self.data_dir / "outbox",  # the broker keeps its log in memory: producers keep theirs
            _env_file=None,
        )

    def dotenv(self) -> str:
        s = self.settings()
        access, secret = s.s3_credentials()
        lines = [
            DOTENV_MARKER,
            f"AWRL_KAFKA_BOOTSTRAP={s.kafka_bootstrap}",
            f"AWRL_S3_ENDPOINT={s.s3_endpoint}",
            f"AWRL_S3_ACCESS_KEY={access}",
            f"AWRL_S3_SECRET_KEY={secret}",
            f"AWRL_S3_BUCKET={s.s3_bucket}",
            f"AWRL_S3_SECURE={str(s.s3_secure).lower()}",
            f"AWRL_LEDGER_URI={s.ledger_uri}",
            f"AWRL_OUTBOX_DIR={s.outbox_dir.resolve()}",
        ]
        if s.vllm_url:
            lines += [f"AWRL_VLLM_URL={s.vllm_url}", f"AWRL_VLLM_MODEL={s.vllm_model}"]
        return "\n".join(lines) + "\n"

    def write_dotenv(self, path: Path) -> bool:
        """Write `.env` for `dagster dev` and the CLI; never overwrite a file a person wrote."""
        if path.exists() and not path.read_text().startswith(DOTENV_MARKER):
            return False
        _write_private(path, self.dotenv())
        return True

    def health(self) -> dict[str, bool]:
        out = {s.name: pid_alive(s) for s in self.services}
        if "kafka" in out:
            out["kafka"] = out["kafka"] and port_open(int(self.kafka_bootstrap.rsplit(":", 1)[1]))
        if "s3" in out and self.s3 is not None:
            out["s3"] = out["s3"] and s3_healthy(self.s3)
        for s in self.services:
            if s.name == "vllm":
                out["vllm"] = out["vllm"] and vllm_healthy(s.port)
        return out

    def healthy(self) -> bool:
        h = self.health()
        return bool(h) and all(h.values())


def _write_private(path: Path, text: str) -> None:
    """Write atomically with mode 0600 (the file may hold credentials)."""
    write_atomic(path, text, mode=0o600)
