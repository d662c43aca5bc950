"""Resident-memory probes for CPU runs (Linux /proc)."""

from __future__ import annotations


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def rss_mib() -> float:
    return _status_kib("VmRSS") / 1024


def hwm_mib() -> float:
    return _status_kib("VmHWM") / 1024


def reset_hwm() -> None:
    """Reset the resident high-water mark to the current RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
