"""Errors of the Wikipedia client and dataset builder, and the one-line messages they carry.

The build tells apart a request that failed for good (:class:`RequestFailed`: the titles it
concerned are recorded as failed and the build goes on) from an endpoint that cannot be reached
at all (:class:`ApiUnreachable`: every other request would fail the same way, so it stops).
"""

from __future__ import annotations

from typing import Any

from common.data.reading import DataError

__all__ = ["WikiError", "RequestFailed", "ApiUnreachable", "one_line"]


class WikiError(DataError):
    """A Wikipedia fetch went wrong; the message is one line, meant for the user."""


class RequestFailed(WikiError):
    """One request failed for good: out of retries, an HTTP 4xx, or an API error.

    The build records the titles it concerned as failed, with this message as the reason, and
    goes on with the rest.
    """


class ApiUnreachable(WikiError):
    """No attempt at a request could even connect: the endpoint is down or wrong.

    Every other request would fail the same way, so the build stops.
    """


def one_line(value: Any, limit: int = 200) -> str:
    """``value`` as one line of at most ``limit`` characters, for an error message.

    Parameters
    ----------
    value : Any
        A MediaWiki error object (its ``info``, ``message`` or ``code`` is taken), an
        exception, or any other value.
    limit : int, default 200
        Longer text is cut and ends in ``...``.

    Returns
    -------
    str
    """
    if isinstance(value, dict):
        value = value.get("info") or value.get("message") or value.get("code") or value
    text = " ".join(str(value).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
