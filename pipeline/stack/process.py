"""Starting and stopping processes: the stack's daemons (`spawn`, detached: they outlive the command that
started them) and a command's children (`start_child`, killed with it), by PID, never by name.

Every daemon is started in its own session (so `awrl stack up` can exit and leave it running) and
recorded as a `ServiceProc`. Stopping checks that the PID still runs the binary we started before
signalling it, so a recycled PID of somebody else's process is never killed.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO

import psutil

LOOPBACK_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))
"""HTTP to our own services on 127.0.0.1, whatever http_proxy says."""


class StackError(RuntimeError):
    """A stack service could not start or be reached; the message says which and why."""


@dataclass(frozen=True)
class ServiceProc:
    """One daemon we started."""

    name: str
    """Service name shown by `awrl stack status` (e.g. `kafka`, `ceph-mon`, `s3`)."""
    pid: int
    """Process id we started; the only handle `down` uses."""
    port: int | None
    """TCP port on 127.0.0.1 it serves, if any."""
    binary: str
    """Absolute path of the executable; checked against /proc before signalling the PID."""
    argv: tuple[str, ...] = ()
    """Command line it was started with, so `respawn` can start it again identically."""
    log: str = ""
    """Where its stdout/stderr go."""
    env: tuple[tuple[str, str], ...] = ()
    """Extra environment it was started with."""
    process_group: bool = False
    """It starts children of its own (vLLM's engine core): `stop` signals its whole process group."""

    def to_dict(self) -> dict:
        return asdict(self)


def require_binary(path: str | os.PathLike, hint: str) -> str:
    """Fail fast, naming the missing binary and how to install it."""
    p = Path(path)
    if not (p.is_file() and os.access(p, os.X_OK)):
        raise StackError(f"binary not found or not executable: {p} ({hint})")
    return str(p)


def free_port() -> int:
    """A port free now, drawn below the kernel's ephemeral range. A port from that range (what
    `bind(0)` returns) can be handed by the kernel to any outgoing connection or `bind(0)` (torchrun's
    rendezvous, gloo, a client) between this probe and the server's own bind: seen as EADDRINUSE on the
    trainer's weight-push port. Drawn with the system's randomness, so processes seeded alike still
    draw apart."""
    low = _ephemeral_low()
    for _ in range(200):
        port = _draw.randrange(10000, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # that range is full: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_draw = random.SystemRandom()


def _ephemeral_low() -> int:
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return low if low > 11000 else 32768


def ensure_port_free(port: int, service: str) -> None:
    with socket.socket() as s:
        # As the daemons do: a port held only by connections in TIME_WAIT (a restart) is free.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError as exc:
            raise StackError(f"{service}: port 127.0.0.1:{port} is already taken ({exc.strerror})") from None


def port_open(port: int, host: str = "127.0.0.1", timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def spawn(
    name: str,
    argv: list[str],
    log_path: Path,
    port: int | None = None,
    env: dict | None = None,
    process_group: bool = False,
) -> ServiceProc:
    """Start a daemon detached from our session; stdout/stderr go to `log_path`."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
    return ServiceProc(
        name=name,
        pid=proc.pid,
        port=port,
        binary=os.path.realpath(argv[0]),
        argv=tuple(argv),
        log=str(log_path),
        env=tuple(sorted((env or {}).items())),
        process_group=process_group,
    )


def dies_with_parent(command: list[str]) -> list[str]:
    """`command`, killed by the kernel when the process that started it dies (util-linux's `setpriv
    --pdeathsig`, kept across exec). torchrun starts each rank in a session of its own, and
    `start_child` each child in one of its own: without this a SIGKILLed `awrl train` left torchrun and
    its ranks training beside the trainer started in its place (seen in a chaos soak: the same groups
    trained twice, the same version numbers published twice)."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "KILL", "--", *command] if setpriv else command


def start_child(command: list[str], env: dict[str, str] | None = None, log: IO | None = None) -> subprocess.Popen:
    """Start a child of this command (a run's ledger writer, torchrun) in a process group of its own,
    so `stop_child` reaches its own children too, and killed with this process (`dies_with_parent`)."""
    return subprocess.Popen(
        dies_with_parent(command),
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT if log else None,
        start_new_session=True,
    )


def stop_child(proc: subprocess.Popen, timeout_s: float = 30.0) -> int:
    """SIGTERM the child's whole process group, SIGKILL if it lingers; its exit status."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode


def respawn(proc: ServiceProc, timeout: float = 60.0) -> ServiceProc:
    """Start a stopped daemon again with the same command line; waits for its port if it has one."""
    if not proc.argv:
        raise StackError(f"{proc.name}: started by an older version, its command line is unknown; restart the stack")
    new = spawn(
        proc.name, list(proc.argv), Path(proc.log), port=proc.port, env=dict(proc.env), process_group=proc.process_group
    )
    if proc.port is not None:
        wait_until(lambda: port_open(proc.port), proc.name, timeout, new, Path(proc.log))
    return new


def wait_until(check, what: str, timeout: float, proc: ServiceProc | None = None, log_path: Path | None = None) -> None:
    """Poll `check()` until true; fail with the log tail if the process died or time ran out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        if proc is not None and not pid_alive(proc):
            raise StackError(f"{what}: process {proc.pid} exited during startup{_tail(log_path)}")
        time.sleep(0.1)
    raise StackError(f"{what}: not ready after {timeout:.0f}s{_tail(log_path)}")


def _tail(log_path: Path | None, n: int = 15) -> str:
    if log_path is None or not log_path.exists():
        return ""
    lines = log_path.read_text(errors="replace").splitlines()[-n:]
    return "\n  log " + str(log_path) + ":\n    " + "\n    ".join(lines)


def pid_alive(proc: ServiceProc) -> bool:
    """True if `proc.pid` runs and still is the binary we started (guards against PID reuse)."""
    try:
        p = psutil.Process(proc.pid)
        exe, status = p.exe(), p.status()
    except psutil.Error:
        return False
    return status != psutil.STATUS_ZOMBIE and os.path.realpath(exe.removesuffix(" (deleted)")) == proc.binary


def stop(proc: ServiceProc, timeout: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after `timeout`; reaps it if it is our child. A `process_group` service
    gets each signal as a group (its session was started with it, so the group id is its PID), and
    members left after the leader exits are killed."""
    group = proc.process_group and pid_alive(proc)  # only a group we saw led by our process

    def alive() -> bool:
        return pid_alive(proc) or (group and _group_alive(proc.pid))

    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
        if not alive():
            break
        try:
            (os.killpg if group else os.kill)(proc.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and alive():
            _reap(proc.pid)
            time.sleep(0.05)
    _reap(proc.pid)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
