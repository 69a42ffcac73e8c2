"""Where the stack is: one settings object, read in one order by every verb and service.

First the environment (`AWRL_*`), then `./.env`, then the embedded stack's own record
(`<AWRL_DATA_DIR or .awrl/stack>/stack.env`, written by `awrl stack up`, `awrl run` and `make demo`).
`awrl stack up` also writes a `.env` of the same shape; docker-compose reads the same variables, so
`dagster dev`, the CLI and the containers configure the code identically.
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import SecretStr
from pydantic_settings import BaseSettings, DotEnvSettingsSource, PydanticBaseSettingsSource, SettingsConfigDict

DOTENV = Path(".env")
STACK_DIR = Path(".awrl/stack")
"""Where the embedded stack keeps its data unless `AWRL_DATA_DIR` says otherwise."""


class MissingSettings(RuntimeError):
    """A setting the command needs is nowhere: not in the environment, `.env` nor a local stack."""


def stack_dir() -> Path:
    """The embedded stack's data directory: `AWRL_DATA_DIR`, else `.awrl/stack`."""
    return Path(os.environ.get("AWRL_DATA_DIR") or STACK_DIR)


class StackSettings(BaseSettings):
    """Connection settings for the event log and the object store (env prefix `AWRL_`)."""

    model_config = SettingsConfigDict(env_prefix="AWRL_", env_file=DOTENV, extra="ignore", frozen=True)

    @classmethod
    def settings_customise_sources(
        cls, settings_cls, init_settings, env_settings, dotenv_settings, file_secret_settings
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # pydantic-settings: the later of several env files wins, and the environment beats them all.
        if dotenv_settings.env_file == DOTENV:  # not overridden by `_env_file`
            dotenv_settings = DotEnvSettingsSource(settings_cls, env_file=(stack_dir() / "stack.env", DOTENV))
        return init_settings, env_settings, dotenv_settings, file_secret_settings

    kafka_bootstrap: str = "127.0.0.1:9092"
    """Kafka-protocol bootstrap address (Tansu locally, Apache Kafka in docker-compose)."""
    kafka_compression: str | None = None
    """Producer compression (`zstd`, `gzip` or none). None by default: on loopback, compressing in
    the client costs more CPU than the bytes it saves (measured 5.2k vs 2.5k events/s with zstd);
    across a real network to Apache Kafka, `zstd` cuts the bytes ~2.5x."""
    topic_prefix: str = "awrl"
    """Prefix of every topic name, so several deployments can share one cluster."""
    s3_endpoint: str = "127.0.0.1:9000"
    """S3 endpoint host:port (Ceph radosgw locally, MinIO in docker-compose)."""
    s3_access_key: SecretStr | None = None
    """S3 access key; generated per stack by `awrl stack up`, never a default."""
    s3_secret_key: SecretStr | None = None
    """S3 secret key; generated per stack by `awrl stack up`, never a default."""
    s3_bucket: str = "awrl"
    """Bucket holding screenshots, checkpoints and the ledger."""
    s3_secure: bool = False
    """Use HTTPS to reach the S3 endpoint."""
    ledger_uri: str = "s3://awrl/ledger"
    """Root of the Parquet ledger: `s3://bucket/prefix` or a local directory."""
    vllm_url: str | None = None
    """OpenAI-compatible policy server for `--policy vllm` (`awrl stack up --vllm`, or docker-compose's
    `vllm` service); None when the stack runs none."""
    vllm_model: str = "policy"
    """The model name that server serves (its `--served-model-name`)."""
    outbox_dir: Path | None = None
    """Where producers keep each event until the ledger has it (`pipeline.outbox`), so that a broker
    which loses its log (the embedded one keeps it in memory) loses no event; None: no outbox."""
    viewer_url: str = "http://127.0.0.1:8765"
    """Where `awrl view` serves the trajectory viewer: the base of the links that `awrl runs`, `make demo`
    and the Dagster assets' metadata print."""

    def with_ledger(self, ledger_uri: str | None) -> StackSettings:
        """These settings with another ledger root (a `--ledger` option), or unchanged for None."""
        return self.model_copy(update={"ledger_uri": ledger_uri}) if ledger_uri else self

    def s3_credentials(self) -> tuple[str, str]:
        if self.s3_access_key is None or self.s3_secret_key is None:
            raise MissingSettings(
                "S3 credentials missing: start the local stack (`awrl stack up`, or `make demo`), or set "
                "AWRL_S3_ACCESS_KEY and AWRL_S3_SECRET_KEY in the environment or .env (see .env.example)"
            )
        return self.s3_access_key.get_secret_value(), self.s3_secret_key.get_secret_value()

    def environ(self) -> dict[str, str]:
        """These settings as `AWRL_*` variables, for child processes (trainer ranks, CLI calls)."""
        out = {}
        for name, value in self.model_dump().items():
            if value is None:
                continue
            value = value.get_secret_value() if isinstance(value, SecretStr) else value
            out[f"AWRL_{name.upper()}"] = str(value).lower() if isinstance(value, bool) else str(value)
        return out
