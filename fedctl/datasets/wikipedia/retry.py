"""How the Wikipedia client retries: the back-off policy and ``Retry-After`` parsing."""

from __future__ import annotations

import email.utils
import random
from dataclasses import dataclass
from datetime import datetime, timezone

__all__ = ["RetryPolicy", "parse_retry_after"]


@dataclass(frozen=True)
class RetryPolicy:
    """How requests are retried.

    Attempt ``k`` (0-based) that fails waits ``uniform(0, min(max_backoff, backoff * 2**k))``
    seconds ("full jitter"), or, if the server sent ``Retry-After``, that many seconds (capped at
    ``max_retry_after``) plus up to ``backoff`` seconds of jitter.

    Attributes
    ----------
    retries : int, default 5
        Attempts after the first one; 0 disables retrying.
    backoff : float, default 1.0
        Base delay in seconds.
    max_backoff : float, default 60.0
        Ceiling of one back-off delay, in seconds.
    max_retry_after : float, default 120.0
        Ceiling of a server-requested wait, in seconds.
    timeout : float, default 30.0
        Read time-out of one attempt, in seconds (the connect time-out is at most 10 s).
    """

    retries: int = 5
    backoff: float = 1.0
    max_backoff: float = 60.0
    max_retry_after: float = 120.0
    timeout: float = 30.0

    def __post_init__(self) -> None:
        if self.retries < 0:
            raise ValueError(f"retries must be >= 0, got {self.retries}")
        if self.backoff < 0 or self.max_backoff < 0 or self.max_retry_after < 0:
            raise ValueError("back-off delays must be >= 0")
        if not self.timeout > 0:
            raise ValueError(f"timeout must be > 0, got {self.timeout}")

    def delay(self, attempt: int, retry_after: float | None = None) -> float:
        """Seconds to wait after failed attempt ``attempt`` (0-based)."""
        if retry_after is not None:
            return min(retry_after, self.max_retry_after) + random.uniform(0, self.backoff)
        return random.uniform(0, min(self.max_backoff, self.backoff * 2**attempt))


def parse_retry_after(value: str | None) -> float | None:
    """Seconds from a ``Retry-After`` header (delta-seconds or an HTTP date); None if unusable."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return max(0.0, (when - datetime.now(timezone.utc)).total_seconds())
