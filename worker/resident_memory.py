"""Resident memory of a process, from Linux /proc: all of it (VmRSS), the anonymous part (RssAnon:
what the process allocated, without the file pages it maps, whose count depends on what the page
cache happens to hold) and the peak (VmHWM, which this process can restart)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


def status_bytes(*fields: str, pid: int | str = "self") -> dict[str, int | None]:
    """Bytes of each /proc/PID/status field named (VmRSS, RssAnon, VmHWM, ...); None where it
    cannot be read."""
    found: dict[str, int | None] = dict.fromkeys(fields)
    try:
        with open(f"/proc/{pid}/status") as handle:
            for line in handle:
                name, _, value = line.partition(":")
                if name in found:
                    found[name] = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return found


def reset_peak() -> bool:
    """Starts a new peak (VmHWM) measurement of this process; False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


@contextmanager
def growth() -> Iterator[dict[str, int | None]]:
    """What the block added to this process's memory, filled in when it ends:
    num_rss_load_bytes, num_anon_rss_load_bytes and num_peak_rss_load_bytes (the peak during the
    block over the resident set before it); None where unreadable."""
    grown: dict[str, int | None] = {}
    before = status_bytes("VmRSS", "RssAnon")
    is_peak_reset = reset_peak()
    yield grown
    after = status_bytes("VmRSS", "RssAnon", "VmHWM")

    def difference(later: int | None, earlier: int | None) -> int | None:
        return None if later is None or earlier is None else later - earlier

    grown["num_rss_load_bytes"] = difference(after["VmRSS"], before["VmRSS"])
    grown["num_anon_rss_load_bytes"] = difference(after["RssAnon"], before["RssAnon"])
    grown["num_peak_rss_load_bytes"] = difference(after["VmHWM"] if is_peak_reset else None, before["VmRSS"])
