"""The on-disk cache of successful Wikipedia API responses, one JSON file per request.

It is what lets an interrupted build resume without fetching anything twice.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from common.atomic import atomic_write_bytes

__all__ = ["ResponseCache", "default_cache_dir"]

log = logging.getLogger("fedctl.wikipedia")


def default_cache_dir() -> Path:
    """``~/.cache/fedctl/wikipedia``."""
    return Path.home() / ".cache" / "fedctl" / "wikipedia"


class ResponseCache:
    """Successful responses on disk: ``<folder>/<key[:2]>/<key>.json``, written atomically.

    The key is the sha256 of the method, URL, sorted parameters and body of the request, so a
    continuation request (which carries its ``continue`` token) has its own entry. A file that
    cannot be read or parsed counts as a miss and is fetched again.

    Parameters
    ----------
    folder : str or Path
        Created on first write.
    """

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder).expanduser()

    @staticmethod
    def key(method: str, url: str, params: dict[str, Any] | None = None,
            body: Any = None) -> str:
        """sha256 hex digest identifying one request."""
        h = hashlib.sha256()
        h.update(method.upper().encode())
        h.update(b"\n" + url.encode("utf-8") + b"\n")
        h.update(urlencode(sorted((params or {}).items())).encode("utf-8"))
        h.update(b"\n")
        if body is not None:
            h.update(json.dumps(body, sort_keys=True, separators=(",", ":")).encode("utf-8"))
        return h.hexdigest()

    def _path(self, key: str) -> Path:
        return self.folder / key[:2] / f"{key}.json"

    def get(self, key: str) -> Any | None:
        """The cached response body, or None."""
        path = self._path(key)
        try:
            return json.loads(path.read_bytes())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            log.warning("wikipedia cache: ignoring unreadable %s (%s)", path, exc)
            return None

    def put(self, key: str, obj: Any) -> None:
        """Store ``obj`` (a parsed JSON body) under ``key``, atomically.

        A reader (or a resumed run) sees a whole entry or none. Not fsynced: two fsyncs per
        response cost ~9 ms each here and capped throughput at high concurrency, and an entry
        garbled by a power cut fails to parse on reading and is simply fetched again.
        """
        atomic_write_bytes(self._path(key), json.dumps(obj, ensure_ascii=False).encode("utf-8"),
                           durable=False)
