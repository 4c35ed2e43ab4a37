"""The master's memory ceiling: what bounds the requests ZeroMQ holds before the master reads them.

libzmq delivers a request only once it holds all of its frames, and ``ZMQ_MAXMSGSIZE`` bounds
each frame, not their number: one request of a thousand frames under the limit, from any peer
that reaches the REP port (an admitted member under CURVE), fills the master's memory before
the master can look at it and refuse it. No socket option bounds a whole message, so the master
watches its own resident memory while it waits on requests. Past the ceiling it closes the REP
socket, which frees every connection's queue and the request being received on it, and binds
again: the honest workers' requests in flight go with them, and their retries (Lazy Pirate)
send them again.

Linux only (``/proc``); elsewhere the ceiling is off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import time
from pathlib import Path
from typing import Any

import common.constants as C

log = logging.getLogger("fedctl.master")

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resident_bytes() -> int | None:
    """This process's resident memory (``/proc/self/statm``), or None where there is no /proc.
    Hand-written: psutil for this alone is not worth a dependency."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return None


def available_bytes() -> int | None:
    """The machine's memory available to new work (``MemAvailable``), or None."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, IndexError, ValueError):
        pass
    return None


@functools.cache
def _libc() -> Any:
    name = ctypes.util.find_library("c")  # runs ldconfig: once
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


def release_freed_memory() -> None:
    """Hand freed heap pages back to the system (glibc's ``malloc_trim``): the frames of many
    small parts were allocated on the heap, and freeing them leaves the resident size where it
    was until the heap is trimmed. A no-op without glibc."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def default_limit() -> int | None:
    """The ceiling when ``memory_limit_mb`` is not set: the master's memory now plus
    ``MEMORY_LIMIT_SHARE`` of what the machine has available (None without /proc)."""
    rss, free = resident_bytes(), available_bytes()
    if rss is None or free is None:
        return None
    return rss + int(free * C.MEMORY_LIMIT_SHARE)


class MemoryCeiling:
    """Checks the master's resident memory against ``limit`` bytes, at most once every
    ``interval`` seconds (a read of /proc costs ~20 µs; the master's loop turns every few ms).

    Parameters
    ----------
    limit : int or None
        Bytes of resident memory; None turns the ceiling off.
    interval : float, default MEMORY_CHECK_INTERVAL
        Seconds between two reads.
    """

    def __init__(self, limit: int | None, interval: float = C.MEMORY_CHECK_INTERVAL) -> None:
        self.limit = limit if resident_bytes() is not None else None
        self.interval = interval
        self._next = 0.0

    def over(self) -> int | None:
        """The resident bytes when they are past the limit, else None."""
        if self.limit is None:
            return None
        now = time.monotonic()
        if now < self._next:
            return None
        self._next = now + self.interval
        rss = resident_bytes()
        return rss if rss is not None and rss > self.limit else None

    def settle(self, timeout: float = C.MEMORY_SETTLE_S) -> int | None:
        """The resident bytes once a closed socket's queues are freed (libzmq frees them on its
        own thread): read until they fall under the limit or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        while True:
            release_freed_memory()
            rss = resident_bytes()
            if rss is None or self.limit is None or rss <= self.limit:
                return rss
            if time.monotonic() >= deadline:
                return rss
            time.sleep(0.05)

    def raise_to(self, rss: int) -> None:
        """The master's own memory (not queued requests) is past the limit: move the limit
        above it, so that a ceiling set too low does not drop the workers' connections at every
        check."""
        self.limit = int(rss * 1.25)
