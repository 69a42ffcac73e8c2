"""A single-node Ceph radosgw (one mon, one OSD, one rgw) on 127.0.0.1 as the stack's S3 store.

Why it is set up this way:
- cephx is off and every `ms_*_mode` is `crc`: with any `secure` mode radosgw fails mon auth
  (get_initial_auth_request returned -13) and hangs for 300 s. Nothing listens beyond 127.0.0.1,
  and S3 access is still guarded by the rgw user's keys.
- Daemons run in the foreground (`-f`), each in its own session via `spawn`: the PID we record is
  the daemon itself (so `stop` signals the right process) and `awrl stack up` may exit and leave it.
- `durable=False` uses memstore: fast and nothing to clean, but every start is a fresh cluster.
  `durable=True` uses bluestore on a sparse file in the data dir so objects survive a restart.
- A full cluster (memstore: 4 GiB; bluestore: 8 GiB) does not refuse a write, it holds it until
  space is freed (measured: the 67th 64 MiB object into memstore waited for ever). So clients time
  out (`pipeline.s3.STORE_READ_TIMEOUT_S`), and deleted objects are garbage-collected within
  ~10 s (`rgw gc obj min wait = 0`): with Ceph's default of 2 hours, a deleted checkpoint's data
  (every part past the first 4 MiB) kept its space, and a store emptied and refilled stalled.
- The mon address is baked into the monmap at mkfs, so a durable restart must reuse the mon port.
  The rgw port lives only in ceph.conf, which is rewritten on every start from the state file.
- The state file (fsid, ports, S3 keys) is mode 0600: it holds the only credentials for the store.
  It is written last on a fresh start, so a half-initialised directory is redone, not reused.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

from pipeline.files import write_atomic
from pipeline.stack.process import (
    LOOPBACK_HTTP,
    ServiceProc,
    StackError,
    ensure_port_free,
    free_port,
    port_open,
    require_binary,
    spawn,
    stop,
    wait_until,
)

_HINT = "apt-get install radosgw ceph-mon ceph-osd"
_BINARIES = ("ceph-mon", "ceph-osd", "radosgw", "radosgw-admin", "ceph", "monmaptool", "ceph-authtool")
_STATE = "ceph-stack.json"
# Everything a fresh start may delete; logs are kept so a failed earlier start can still be read.
_OWNED = ("mon", "osd0", "rgw", "run", "monmap", "keyring", "ceph.conf", _STATE)
_S3_USER = "awrl"


@dataclass(frozen=True)
class S3Credentials:
    endpoint: str
    """`127.0.0.1:PORT` of radosgw (no scheme; plain HTTP)."""
    access_key: str
    secret_key: str


def _conf(d: Path, st: dict, rgw_port: int, bind: str) -> str:
    if st["durable"]:
        # No `bluestore block path`: bluestore then creates osd0/block as a plain sparse file, so
        # 8 GiB costs only what is written (a path there would become a symlink to itself).
        # Fixed small caches keep RSS low (osd_memory_target only steers autotuning, which is off).
        store = f"""osd objectstore = bluestore
bluestore block create = true
bluestore block size = {8 << 30}
bluestore fsck on mkfs = false
bluestore cache autotune = false
bluestore cache size = {64 << 20}
osd memory target = {896 << 20}"""
    else:
        store = f"osd objectstore = memstore\nmemstore device bytes = {4 << 30}"
    return f"""[global]
fsid = {st["fsid"]}
mon host = v2:127.0.0.1:{st["mon_port"]}
mon initial members = a
auth cluster required = none
auth service required = none
auth client required = none
ms mon client mode = crc
ms client mode = crc
ms cluster mode = crc
ms service mode = crc
ms mon cluster mode = crc
ms mon service mode = crc
public addr = 127.0.0.1
cluster addr = 127.0.0.1
ms bind ipv6 = false
ms bind msgr1 = false
osd pool default size = 1
osd pool default min size = 1
osd pool default pg autoscale mode = off
osd pool default pg num = 8
osd pool default pgp num = 8
mon allow pool size one = true
mon warn on pool no redundancy = false
osd crush chooseleaf type = 0
{store}
run dir = {d}/run
log file = {d}/log/$name.log
pid file = {d}/run/$name.pid
keyring = {d}/keyring
[mon.a]
mon data = {d}/mon
# A monitor refuses to start below 5% free disk, however many GiB that is (a large shared disk): the
# stack's few MB of monitor data need no such margin.
mon data avail crit = 0
mon data avail warn = 0
[osd.0]
osd data = {d}/osd0
[client.rgw.a]
rgw frontends = beast endpoint={bind}:{rgw_port} tcp_nodelay=1
rgw data = {d}/rgw
rgw thread pool size = 64
rgw gc obj min wait = 0
rgw gc processor period = 10
"""


def _run(argv: list[str], what: str, timeout: float) -> str:
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise StackError(f"{what}: timed out after {timeout:.0f}s ({' '.join(argv)})") from None
    if r.returncode != 0:
        raise StackError(f"{what}: exit {r.returncode}: {(r.stderr or r.stdout).strip()[-800:]}")
    return r.stdout


def _write_state(d: Path, st: dict) -> None:
    write_atomic(d / _STATE, json.dumps(st), mode=0o600)


def _port_free(port: int) -> bool:
    """Like `ensure_port_free`, except that TIME_WAIT leftovers of our own last run do not count.

    Right after a stop the mon and rgw ports sit in TIME_WAIT for a minute, so a plain bind fails;
    ceph and beast bind with SO_REUSEADDR and can take them. With it set, a listener still conflicts.
    """
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _ensure_port_free(port: int, service: str) -> None:
    if not _port_free(port):
        ensure_port_free(port, service)  # raises, with the OS's reason
        raise StackError(f"{service}: port 127.0.0.1:{port} is already taken")


def _free_port_except(taken: int | None) -> int:
    # free_port releases its probe socket, so two calls may hand out the same port.
    while (port := free_port()) == taken:
        pass
    return port


def _osd_up(ceph: list[str]) -> bool:
    try:
        out = subprocess.run([*ceph, "osd", "stat", "-f", "json"], capture_output=True, text=True, timeout=10)
        return out.returncode == 0 and json.loads(out.stdout).get("num_up_osds") == 1
    except (subprocess.TimeoutExpired, ValueError):
        return False


def s3_healthy(creds: S3Credentials) -> bool:
    """True if radosgw answers HTTP at all (an unauthenticated GET gets some status)."""
    try:
        LOOPBACK_HTTP.open(f"http://{creds.endpoint}/", timeout=2).close()
        return True
    except urllib.error.HTTPError:
        return True
    except (OSError, ValueError):
        return False


def start_ceph_s3(
    data_dir: Path,
    *,
    durable: bool,
    rgw_port: int | None = None,
    timeout: float = 90.0,
    bind: str = "127.0.0.1",
    keys: tuple[str, str] | None = None,
) -> tuple[S3Credentials, list[ServiceProc]]:
    """Start mon, OSD and radosgw for `data_dir`; return S3 credentials and the daemons we started.

    A durable directory that was fully initialised before is restarted as is (same cluster, objects
    and credentials); anything else is wiped and created anew with fresh random keys, or `keys`
    (access, secret) where given. `bind`: the address radosgw listens on (the other daemons stay on
    127.0.0.1); a container that other containers reach gives 0.0.0.0.
    """
    bins = {n: require_binary(shutil.which(n) or f"/usr/bin/{n}", _HINT) for n in _BINARIES}
    d = Path(data_dir).resolve()
    d.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout
    st, fresh = _state(d, durable, rgw_port, keys)
    rgw_port = _rgw_port(st, rgw_port)
    conf = d / "ceph.conf"
    conf.write_text(_conf(d, st, rgw_port, bind))
    for sub in ("mon", "osd0", "rgw", "run", "log"):
        (d / sub).mkdir(exist_ok=True)
    as_root = ["--setuser", "root", "--setgroup", "root"] if os.geteuid() == 0 else []
    cluster = _Cluster(bins, d, ["-c", str(conf)], as_root, deadline)
    if fresh:
        cluster.make_monitor(st)
    procs: list[ServiceProc] = []
    try:
        creds = cluster.start_daemons(st, fresh, rgw_port, procs)
        if fresh or st["rgw_port"] != rgw_port:
            _write_state(d, {**st, "rgw_port": rgw_port})
    except BaseException:
        # Leave nothing half-started behind; the error already names what failed.
        for p in reversed(procs):
            stop(p)
        raise
    return creds, procs


def _state(d: Path, durable: bool, rgw_port: int | None, keys: tuple[str, str] | None) -> tuple[dict, bool]:
    """The cluster's recorded state and whether it is created anew (then `d` is wiped and new keys drawn)."""
    st = json.loads((d / _STATE).read_text()) if (d / _STATE).exists() else None
    if st is not None and st["durable"] and not durable:
        raise StackError(f"ceph: {d} holds a durable store; refusing to wipe it for a non-durable start")
    if st is not None and st["durable"]:
        _ensure_port_free(st["mon_port"], f"ceph-mon (port is fixed in the monmap of {d})")
        return st, False
    for name in _OWNED:
        p = d / name
        shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
    return {
        "fsid": str(uuid.uuid4()),
        "osd_uuid": str(uuid.uuid4()),
        "mon_port": _free_port_except(rgw_port),
        "rgw_port": None,
        "durable": durable,
        "access_key": keys[0] if keys else secrets.token_hex(10).upper(),
        "secret_key": keys[1] if keys else secrets.token_urlsafe(30),
    }, True


def _rgw_port(st: dict, asked: int | None) -> int:
    if asked is not None:
        _ensure_port_free(asked, "s3 (radosgw)")
        return asked
    # Keep the previous endpoint across restarts when we can; it is not baked in anywhere.
    port = st["rgw_port"]
    return port if port is not None and _port_free(port) else _free_port_except(st["mon_port"])


@dataclass
class _Cluster:
    """The commands of one cluster directory, within one start-up deadline."""

    bins: dict[str, str]
    d: Path
    conf: list[str]
    """`-c ceph.conf`."""
    user: list[str]
    """Run the daemons as root when we are root (Ceph drops to the `ceph` user otherwise)."""
    deadline: float

    def left(self) -> float:
        return max(1.0, self.deadline - time.monotonic())

    def make_monitor(self, st: dict) -> None:
        b, d = self.bins, self.d
        _run(
            [
                b["ceph-authtool"],
                "--create-keyring",
                str(d / "keyring"),
                "--gen-key",
                "-n",
                "mon.",
                "--cap",
                "mon",
                "allow *",
            ],
            "ceph-authtool",
            self.left(),
        )
        _run(
            [
                b["monmaptool"],
                "--create",
                "--fsid",
                st["fsid"],
                "--addv",
                "a",
                f"[v2:127.0.0.1:{st['mon_port']}]",
                str(d / "monmap"),
            ],
            "monmaptool",
            self.left(),
        )
        _run(
            [
                b["ceph-mon"],
                *self.conf,
                "--mkfs",
                "-i",
                "a",
                "--monmap",
                str(d / "monmap"),
                "--keyring",
                str(d / "keyring"),
                *self.user,
            ],
            "ceph-mon --mkfs",
            self.left(),
        )

    def start_daemons(self, st: dict, fresh: bool, rgw_port: int, procs: list[ServiceProc]) -> S3Credentials:
        """mon, then OSD (created first if `fresh`), then radosgw and its S3 user; each appended to
        `procs` as soon as it runs, so the caller can stop them if a later one fails."""
        b, c, user, logs = self.bins, self.conf, self.user, self.d / "log"
        ceph = [b["ceph"], *c, "--connect-timeout", "10"]
        procs.append(
            spawn("ceph-mon", [b["ceph-mon"], "-f", *c, "-i", "a", *user], logs / "ceph-mon.out", st["mon_port"])
        )
        wait_until(lambda: port_open(st["mon_port"]), "ceph-mon", self.left(), procs[-1], logs / "ceph-mon.out")
        if fresh:
            _run([*ceph, "osd", "new", st["osd_uuid"], "0"], "ceph osd new", self.left())
            _run(
                [b["ceph-osd"], *c, "-i", "0", "--mkfs", "--osd-uuid", st["osd_uuid"], *user],
                "ceph-osd --mkfs",
                self.left(),
            )
        procs.append(spawn("ceph-osd", [b["ceph-osd"], "-f", *c, "-i", "0", *user], logs / "ceph-osd.out"))
        wait_until(lambda: _osd_up(ceph), "ceph-osd up", self.left(), procs[-1], logs / "ceph-osd.out")
        procs.append(spawn("s3", [b["radosgw"], "-f", *c, "-n", "client.rgw.a", *user], logs / "radosgw.out", rgw_port))
        creds = S3Credentials(f"127.0.0.1:{rgw_port}", st["access_key"], st["secret_key"])
        wait_until(lambda: s3_healthy(creds), "radosgw HTTP", self.left(), procs[-1], logs / "radosgw.out")
        if fresh:
            _run(
                [
                    b["radosgw-admin"],
                    *c,
                    "user",
                    "create",
                    f"--uid={_S3_USER}",
                    f"--display-name={_S3_USER}",
                    f"--access-key={st['access_key']}",
                    f"--secret-key={st['secret_key']}",
                ],
                "radosgw-admin user create",
                self.left(),
            )
        return creds
