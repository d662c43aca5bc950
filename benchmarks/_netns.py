"""Two Linux network namespaces joined by a veth pair, shaped with ``tc`` (root only).

Used by ``benchmarks.shaped_link``. Every name starts with ``fsdpc-<pid>`` (the
creating process), so a later run can tell leftovers of a dead run
(:func:`remove_stale`) from a run still going. Both veth ends are created directly
inside their namespaces, so deleting the two namespaces removes everything.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading

PREFIX = "fsdpc-"
_NS_RE = re.compile(r"^fsdpc-(\d+)-\d+$")


class LinkSetupError(RuntimeError):
    """Creating or shaping the namespaces failed."""


def _run(*argv: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = (["ip", "netns", "exec", netns] if netns else []) + list(argv)
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        raise LinkSetupError(f"`{' '.join(cmd)}` failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def unavailable() -> str | None:
    """Why namespaces cannot be used here, or ``None``."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "needs root (ip netns, veth and tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) not found"
    proc = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        return f"`ip netns` unavailable: {proc.stderr.strip()}"
    return None


def _namespaces() -> list[str]:
    out = _run("ip", "netns", "list").stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> list[str]:
    """Delete ``fsdpc-<pid>-*`` namespaces whose creating process is gone; their names."""
    removed = []
    for name in _namespaces():
        m = _NS_RE.match(name)
        if m and int(m.group(1)) != os.getpid() and not _pid_alive(int(m.group(1))):
            _run("ip", "netns", "del", name, check=False)
            removed.append(name)
    return removed


def _bits_per_s(rate: str) -> float:
    m = re.fullmatch(r"([\d.]+)\s*([kmg]?)bit", rate.strip().lower())
    if not m:
        raise ValueError(f"link rate {rate!r}: expected e.g. 1gbit, 500mbit")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]


class VethPair:
    """Namespaces ``fsdpc-<pid>-0`` and ``-1``, veth ends ``fsdpc<pid>a`` (10.77.0.1) and
    ``fsdpc<pid>b`` (10.77.0.2). A context manager: removed on exit."""

    def __init__(self) -> None:
        pid = os.getpid()
        self.namespaces = [f"{PREFIX}{pid}-0", f"{PREFIX}{pid}-1"]
        self.devices = [f"fsdpc{pid}a", f"fsdpc{pid}b"]
        self.addresses = ["10.77.0.1", "10.77.0.2"]
        self._created: list[str] = []

    def create(self) -> None:
        for ns in self.namespaces:
            _run("ip", "netns", "add", ns)
            self._created.append(ns)
        a, b = self.devices
        _run("ip", "link", "add", "name", a, "netns", self.namespaces[0], "type", "veth", "peer", "name", b, "netns", self.namespaces[1])
        for ns, dev, addr in zip(self.namespaces, self.devices, self.addresses, strict=True):
            _run("ip", "addr", "add", f"{addr}/24", "dev", dev, netns=ns)
            _run("ip", "link", "set", "lo", "up", netns=ns)
            _run("ip", "link", "set", dev, "up", netns=ns)

    def shape(self, rate: str | None, delay_us: float = 50.0) -> str:
        """Limit both directions (each end's egress) to ``rate`` with ``delay_us`` added
        (netem); where the kernel has no netem, a token bucket (tbf) at ``rate`` and no
        added delay. ``None``: no qdisc. Returns what was applied, in words."""
        for ns, dev in zip(self.namespaces, self.devices, strict=True):
            _run("tc", "qdisc", "del", "dev", dev, "root", netns=ns, check=False)
        if rate is None:
            return "unshaped veth"
        bps = _bits_per_s(rate)
        netem = ["netem", "delay", f"{delay_us:g}us", "rate", rate, "limit", "100000"]
        # tbf: a bucket of 1 ms of traffic (at least 128 KiB, above a 64 KiB GSO segment),
        # up to 20 ms queued before drops.
        tbf = ["tbf", "rate", rate, "burst", str(max(128 << 10, int(bps / 8 / 1000))), "latency", "20ms"]
        applied = "netem"
        for i, (ns, dev) in enumerate(zip(self.namespaces, self.devices, strict=True)):
            if applied == "netem":
                proc = _run("tc", "qdisc", "add", "dev", dev, "root", *netem, netns=ns, check=False)
                if proc.returncode == 0:
                    continue
                if i > 0:
                    raise LinkSetupError(f"netem on {dev}: {proc.stderr.strip()}")
                applied, netem_error = "tbf", proc.stderr.strip()
            _run("tc", "qdisc", "add", "dev", dev, "root", *tbf, netns=ns)
        if applied == "netem":
            return f"netem delay {delay_us:g}us rate {rate}, each direction"
        return f"tbf rate {rate} each direction, no added delay (netem: {netem_error!r})"

    def exec_prefix(self, rank: int) -> list[str]:
        """argv prefix running a command in rank ``rank``'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[rank]]

    def destroy(self) -> None:
        for ns in self._created:
            _run("ip", "netns", "del", ns, check=False)
        self._created = []

    def __enter__(self) -> VethPair:
        try:
            self.create()
        except BaseException:
            self.destroy()
            raise
        return self

    def __exit__(self, *exc) -> None:
        with ignoring_signals():
            self.destroy()


def _raise_exit(signum, frame):
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def _handlers(sigs, handler):
    # Signal handlers can only be set from the main thread; elsewhere, leave them.
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {sig: signal.signal(sig, handler) for sig in sigs}
    try:
        yield
    finally:
        for sig, previous in old.items():
            signal.signal(sig, previous)


def exit_on_signals():
    """SIGTERM and SIGHUP raise ``SystemExit`` (SIGINT already raises ``KeyboardInterrupt``),
    so ``finally`` blocks and ``with`` exits run and remove what was created."""
    return _handlers((signal.SIGTERM, signal.SIGHUP), _raise_exit)


def ignoring_signals():
    """Cleanup that a second Ctrl-C or a SIGTERM must not cut short."""
    return _handlers((signal.SIGINT, signal.SIGTERM, signal.SIGHUP), signal.SIG_IGN)
