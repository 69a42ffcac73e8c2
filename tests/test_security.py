"""Security defaults: the local stack listens on loopback only, and no credential is committed or baked
into an image. (The agent's `goto` allow-list is covered with the other bad model outputs in
test_actions.py; compose's required secrets and loopback ports in test_compose.py.)"""

from __future__ import annotations

import ipaddress
import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's `st` column
LOOPBACK = ipaddress.ip_address("127.0.0.1")


def _listening_sockets() -> dict[int, tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]]:
    """inode -> (address, port) of every TCP socket in LISTEN state in this network namespace."""
    out = {}
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        if not os.path.exists(table):
            continue
        with open(table) as f:
            next(f)
            for line in f:
                fields = line.split()
                if fields[3] != LISTEN:
                    continue
                host, port = fields[1].split(":")
                out[int(fields[9])] = (_address(host, width), int(port, 16))
    return out


def _address(hex_host: str, width: int):
    """/proc/net/tcp* print each 32-bit word of the address in host (little-endian) byte order."""
    raw = bytes.fromhex(hex_host)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(words) if width == 16 else ipaddress.IPv4Address(words)


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed since the listing
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[len("socket:[") : -1]))
    return inodes


def test_every_stack_service_listens_on_loopback_only(stack):
    listening = _listening_sockets()
    seen = {}
    for service in stack.services:
        bound = sorted({listening[i] for i in _socket_inodes(service.pid) if i in listening})
        seen[service.name] = bound
        assert bound, f"{service.name} (pid {service.pid}) listens on nothing"
        assert all(address == LOOPBACK for address, _ in bound), f"{service.name} listens beyond 127.0.0.1: {bound}"
        if service.port is not None:
            assert (LOOPBACK, service.port) in bound, f"{service.name} does not serve its port: {bound}"
    assert {"kafka", "ceph-mon", "ceph-osd", "s3"} <= seen.keys()


# Known credential formats and well-known defaults. Built from parts so that this file, which is
# scanned too, does not match itself.
SECRET_FORMATS = {
    "AWS access key id": re.compile(r"\b(?:AKIA|ASIA|AIDA|AROA)" + r"[0-9A-Z]{16}\b"),
    "AWS documentation secret": re.compile("wJalrXUtnFEMI" + "/K7MDENG"),
    "private key": re.compile("-----BEGIN [A-Z ]*" + "PRIVATE KEY-----"),
    "MinIO default root account": re.compile(r"\bminio" + r"admin\b"),
    "GitHub token": re.compile(r"\bgh[pousr]_" + r"[A-Za-z0-9]{36}\b"),
    "Hugging Face token": re.compile(r"\bhf_" + r"[A-Za-z]{34}\b"),
}
# A bare `token` is left out: tokenizers have `eos_token = "<|im_end|>"` and the like.
CREDENTIAL_NAME = r"[A-Za-z0-9_]*(?:PASSWORD|PASSWD|SECRET|SECRET_KEY|ACCESS_KEY|API_KEY|AUTH_TOKEN|ACCESS_TOKEN)"
# `name = "literal"` / `"name": "literal"` (code, JSON) and `NAME=literal` / `NAME: literal` at the
# start of a line (env files, YAML, Dockerfiles, shell).
QUOTED = re.compile(rf"""\b({CREDENTIAL_NAME})["']?\s*[:=]\s*["']([^"'\s][^"'\n]*)["']""", re.IGNORECASE)
UNQUOTED = re.compile(
    rf"""^[ \t]*(?:ENV\s+|ARG\s+|export\s+|-\s+)?({CREDENTIAL_NAME})[ \t]*[:=][ \t]*([^\s"'#]+)""",
    re.IGNORECASE | re.MULTILINE,
)
CONFIG_FILE = re.compile(r"(^|/)(\.env[^/]*|Dockerfile[^/]*|Makefile|[^/]+\.(ya?ml|toml|ini|cfg|conf|sh))$|^\.ci/")
# What a credential may be set to in committed text: a reference to the environment, a placeholder.
REFERENCE = re.compile(r"^(\$|\{|change-me)")
# ... and, in tests only, values nobody would mistake for a real secret.
FAKE = re.compile(r"^(unused|fake|dummy|wrong|guess|test|example|x+)\b", re.IGNORECASE)


def _project_files() -> list[str]:
    """Tracked files plus new ones not yet committed (but not what .gitignore keeps out, like .env)."""
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout
    return sorted({p for p in out.decode().split("\0") if p and (ROOT / p).is_file()})


def _text(path: str) -> str | None:
    try:
        return (ROOT / path).read_text(encoding="utf-8")
    except UnicodeDecodeError:  # images and other binaries
        return None


def _literal_credentials(path: str, text: str) -> list[str]:
    patterns = [QUOTED, UNQUOTED] if CONFIG_FILE.search(path) else [QUOTED]
    found = []
    for pattern in patterns:
        for m in pattern.finditer(text):
            name, value = m.group(1), m.group(2).strip()
            if REFERENCE.match(value) or (path.startswith("tests/") and FAKE.match(value)):
                continue
            found.append(f"{path}: {name} = {value[:12]!r}")
    return found


def test_no_credentials_in_the_project_files():
    files = _project_files()
    assert ".env" not in files and ".env.example" in files
    found = []
    for path in files:
        text = _text(path)
        if text is None:
            continue
        found += [f"{path}: {what}" for what, pattern in SECRET_FORMATS.items() if pattern.search(text)]
        found += _literal_credentials(path, text)
    assert found == []


def test_the_scan_would_catch_a_committed_secret():
    # Values assembled at run time, so that this file holds none of them literally.
    key_id = "AKIA" + "Q" * 16
    assert SECRET_FORMATS["AWS access key id"].search(f"aws_access_key_id = {key_id}")
    assert _literal_credentials("pipeline/x.py", 'secret_key = "' + "s3cr3t" + '"')
    assert _literal_credentials("docker-compose.yml", "  MINIO_ROOT_" + "PASSWORD: hunter2")
    assert not _literal_credentials("docker/dagster.yaml", "      password:\n        env: DAGSTER_PG_PASSWORD")
    assert _literal_credentials("tests/test_x.py", '"AWRL_PG_PASSWORD": "' + "hunter2" + '"')
    assert not _literal_credentials("tests/test_x.py", '"AWRL_S3_SECRET_KEY": "unused"')
    assert not _literal_credentials(".env.example", "AWRL_S3_SECRET_KEY=change-me-secret-key")
    assert not _literal_credentials("docker-compose.yml", "  POSTGRES_PASSWORD: ${AWRL_PG_PASSWORD:?set it}")


DOCKERFILES = sorted((ROOT / "docker").glob("Dockerfile*"))
SECRET_NAME = re.compile(r"PASSWORD|PASSWD|SECRET|TOKEN|ACCESS_KEY|API_KEY|CREDENTIAL|AWS_|PRIVATE", re.IGNORECASE)


def _env_and_arg_names(dockerfile: Path) -> list[tuple[str, str]]:
    """(instruction, name = value text) of every ENV and ARG, continuation lines joined."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    found = []
    for m in re.finditer(r"^\s*(ENV|ARG)\s+(.+)$", text, re.IGNORECASE | re.MULTILINE):
        for item in re.findall(r"([A-Za-z_][A-Za-z0-9_]*)(?:=(\S*))?", m.group(2)):
            found.append((m.group(1).upper(), f"{item[0]}={item[1]}"))
    return found


@pytest.mark.parametrize(
    "dockerfile", [d for d in DOCKERFILES if not d.name.endswith(".dockerignore")], ids=lambda d: d.name
)
def test_images_get_no_secrets_through_env_or_arg(dockerfile):
    settings = _env_and_arg_names(dockerfile)
    assert settings, "no ENV/ARG found: the parser no longer reads this Dockerfile"
    assert [s for s in settings if SECRET_NAME.search(s[1])] == []
    assert [s for s in settings if re.search(r"://[^/@\s]+:[^/@\s]+@", s[1])] == []  # user:password@ in a URL


def test_the_image_build_context_is_an_allow_list():
    ignore = (ROOT / "docker" / "Dockerfile.dockerignore").read_text().splitlines()
    rules = [line.strip() for line in ignore if line.strip() and not line.startswith("#")]
    assert rules[0] == "*"  # everything out first, so .env or keys can never reach a layer
    assert not any(r.lstrip("!").startswith(".env") for r in rules if r.startswith("!"))


def _env_example() -> list[tuple[list[str], str, str]]:
    """(comment lines just above, name, value) of each setting in .env.example."""
    entries, comments = [], []
    for line in (ROOT / ".env.example").read_text().splitlines():
        if line.startswith("#"):
            comments.append(line)
        elif "=" in line:
            name, _, value = line.partition("=")
            entries.append((comments, name.strip(), value.strip()))
            comments = []
        else:
            comments = []
    return entries


def test_env_example_secrets_are_documented_placeholders():
    secrets = [(c, n, v) for c, n, v in _env_example() if SECRET_NAME.search(n)]
    assert {n for _, n, _ in secrets} >= {"AWRL_S3_ACCESS_KEY", "AWRL_S3_SECRET_KEY", "AWRL_PG_PASSWORD"}
    for comments, name, value in secrets:
        assert value.startswith("change-me"), f"{name} in .env.example must be a change-me placeholder"
        assert comments and len(comments[-1].strip("# ")) > 10, f"{name} needs a comment line above it"
    undocumented = [n for c, n, _ in _env_example() if not c]
    assert undocumented == []
