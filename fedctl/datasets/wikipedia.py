"""Build a labelled text dataset from Wikipedia.

For each title, the lead section comes as plain text from the MediaWiki Action API
(``action=query&prop=extracts&exintro&explaintext``, up to 20 titles a request, following
``normalized``, ``redirects`` and ``continue``); the article's 64 topic probabilities come from
the ``enwiki-articletopic`` model on Wikimedia's Lift Wing inference API; the binary label says
whether the chosen topic (default ``STEM.Technology``) reaches a threshold (default 0.5).

Requests run on a bounded thread pool over one ``requests.Session``. Each is retried with
exponential back-off and full jitter on HTTP 429 and 5xx, time-outs, dropped connections,
malformed JSON and MediaWiki's ``maxlag`` error, honouring ``Retry-After`` (which also pauses
the other threads talking to that host). Every successful response is cached on disk, one JSON
file per request, so an interrupted build resumes without fetching anything twice.

Typical use::

    client = WikiClient(cache=ResponseCache(default_cache_dir()), concurrency=4)
    result = build_dataset(read_titles("titles.txt"), client, topic="STEM.Technology")
    write_jsonl("wiki.jsonl", result.rows)
"""

from __future__ import annotations

import csv
import email.utils
import hashlib
import io
import json
import logging
import random
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlencode, urlsplit

import requests
from requests.adapters import HTTPAdapter

from common.atomic import atomic_write_bytes
from common.data.reading import DataError
from fedctl.datasets.taxonomy import DEFAULT_TOPIC, check_topic

__all__ = [
    "DEFAULT_API_URL",
    "DEFAULT_TOPIC_API_URL",
    "DEFAULT_TOPIC",
    "MAX_TITLES_PER_QUERY",
    "MAX_INTRO_EXTRACTS",
    "WikiError",
    "ApiUnreachable",
    "RequestFailed",
    "RetryPolicy",
    "ResponseCache",
    "Page",
    "WikiClient",
    "BuildResult",
    "build_dataset",
    "default_cache_dir",
    "default_user_agent",
    "clean_title",
    "read_titles",
    "read_history",
    "dedupe",
    "write_jsonl",
]

log = logging.getLogger("fedctl.wikipedia")

DEFAULT_API_URL = "https://en.wikipedia.org/w/api.php"
DEFAULT_TOPIC_API_URL = (
    "https://api.wikimedia.org/service/lw/inference/v1/models/enwiki-articletopic:predict"
)
#: ``titles=`` takes at most 50 values for normal clients (500 for bots).
MAX_TITLES_PER_QUERY = 50
#: ``prop=extracts`` with ``exintro`` returns at most 20 extracts per request (``exlimit``).
MAX_INTRO_EXTRACTS = 20
#: ``list=random`` and ``list=categorymembers`` return at most 500 entries per request.
MAX_LIST_LIMIT = 500

# Characters MediaWiki never allows in a title; '|' would also split the titles= parameter.
_BAD_TITLE_CHARS = re.compile(r"[<>\[\]{}|\x00-\x1f\x7f]")
_MAX_CONTINUATIONS = 1000


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


class _Retryable(Exception):
    """Internal: one attempt failed in a way worth retrying."""

    def __init__(self, reason: str, retry_after: float | None = None,
                 connect: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry_after = retry_after
        self.connect = connect


# --------------------------------------------------------------------------------------------
# Retries and the response cache
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# The client
# --------------------------------------------------------------------------------------------


def default_user_agent(contact: str | None = None) -> str:
    """A User-Agent as Wikimedia's policy asks: ``name/version (contact) library/version``.

    Parameters
    ----------
    contact : str or None, default None
        An e-mail address or URL where the operator can be reached.
    """
    try:
        from importlib.metadata import version

        ours = version("fedctl")
    except Exception:  # noqa: BLE001 - not installed (running from a checkout)
        ours = "0"
    about = "federated-learning text dataset builder"
    if contact:
        about += f"; {contact}"
    return f"fedctl/{ours} ({about}) python-requests/{requests.__version__}"


@dataclass
class Page:
    """What the API says about one requested title.

    Attributes
    ----------
    title : str
        The final title, after normalization and redirects.
    pageid, revid : int or None
        None for a missing or invalid page.
    text : str
        The plain-text lead section ("" if none).
    missing : bool
    disambiguation : bool
    invalid : str or None
        Why the title is not a valid page title (invalid characters, interwiki, special page).
    normalized, redirected : bool
        Whether the requested title was normalized / followed a redirect to get here.
    """

    title: str
    pageid: int | None = None
    revid: int | None = None
    text: str = ""
    missing: bool = False
    disambiguation: bool = False
    invalid: str | None = None
    normalized: bool = False
    redirected: bool = False


def _flag(obj: dict[str, Any], name: str) -> bool:
    """MediaWiki booleans: present as "" in formatversion 1, true/false in formatversion 2."""
    value = obj.get(name, False)
    return value is not False and value is not None


def _pages_of(query: dict[str, Any]) -> list[dict[str, Any]]:
    pages = query.get("pages") or []
    if isinstance(pages, dict):  # formatversion 1: keyed by page id as a string
        pages = list(pages.values())
    return [p for p in pages if isinstance(p, dict) and isinstance(p.get("title"), str)]


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def parse_topic_scores(obj: Any, revid: int) -> dict[str, float]:
    """All topic probabilities from a Lift Wing ``articletopic`` response.

    Accepts ``{"<wiki>": {"scores": {"<revid>": {"articletopic": {"score": {"probability":
    {label: p}}}}}}}``; the wiki key is not assumed to be ``enwiki``.

    Raises
    ------
    RequestFailed
        If the model reported an error for the revision or the shape is not as above.
    """
    if not isinstance(obj, dict):
        raise RequestFailed("topic API: response is not a JSON object")
    if "error" in obj and not any(isinstance(v, dict) and "scores" in v for v in obj.values()):
        raise RequestFailed(f"topic API error: {_one_line(obj['error'])}")
    for wiki in obj.values():
        if not (isinstance(wiki, dict) and isinstance(wiki.get("scores"), dict)):
            continue
        scores = wiki["scores"]
        entry = scores.get(str(revid))
        if entry is None and len(scores) == 1:
            entry = next(iter(scores.values()))
        if not isinstance(entry, dict):
            raise RequestFailed(f"topic API: no scores for revision {revid}")
        model = entry.get("articletopic")
        if model is None and len(entry) == 1:
            model = next(iter(entry.values()))
        if isinstance(model, dict) and "error" in model:
            raise RequestFailed(f"topic API error: {_one_line(model['error'])}")
        probs = (model or {}).get("score", {}).get("probability") if isinstance(
            model, dict) else None
        if not isinstance(probs, dict) or not probs:
            raise RequestFailed(f"topic API: no probabilities for revision {revid}")
        try:
            return {str(k): float(v) for k, v in probs.items()}
        except (TypeError, ValueError):
            raise RequestFailed("topic API: a probability is not a number") from None
    raise RequestFailed("topic API: response has no 'scores'")


def _describe_connection_error(exc: requests.ConnectionError) -> tuple[str, bool]:
    """A short reason, and whether the connection could not even be opened.

    A refused or unresolvable host makes the endpoint unreachable; a dropped keep-alive
    connection ("Connection aborted") is a transient hiccup. Both are retried, but only the
    first kind, on every attempt, ends the build.
    """
    text = str(exc)
    if "NameResolutionError" in text or "Failed to resolve" in text:
        return "cannot resolve the host name", True
    if "Connection refused" in text:
        return "connection refused", True
    if "NewConnectionError" in text:
        return "cannot open a connection", True
    if "RemoteDisconnected" in text or "Connection aborted" in text:
        return "connection closed by the server", False
    return f"connection error: {_one_line(text, 120)}", False


def _one_line(value: Any, limit: int = 200) -> str:
    if isinstance(value, dict):
        value = value.get("info") or value.get("message") or value.get("code") or value
    text = " ".join(str(value).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


class WikiClient:
    """MediaWiki Action API and Lift Wing client with retries, back-off and a response cache.

    Safe to use from many threads at once: one ``requests.Session`` whose connection pool holds
    ``concurrency`` connections per host.

    Parameters
    ----------
    api_url : str, default :data:`DEFAULT_API_URL`
        The Action API endpoint (``.../w/api.php``) of the wiki or a mirror.
    topic_api_url : str, default :data:`DEFAULT_TOPIC_API_URL`
        Lift Wing's ``enwiki-articletopic:predict`` endpoint or a mirror.
    concurrency : int, default 4
        Connections kept per host; match the size of the thread pool that uses the client.
    retry : RetryPolicy, default RetryPolicy()
    cache : ResponseCache or None, default None
        None: no caching.
    user_agent : str or None, default None
        None means :func:`default_user_agent`.
    maxlag : int or None, default 5
        Sent with every Action API request: the API refuses (and we wait and retry) while its
        database replicas lag more than this many seconds. None: not sent.
    """

    def __init__(
        self,
        api_url: str = DEFAULT_API_URL,
        topic_api_url: str = DEFAULT_TOPIC_API_URL,
        *,
        concurrency: int = 4,
        retry: RetryPolicy | None = None,
        cache: ResponseCache | None = None,
        user_agent: str | None = None,
        maxlag: int | None = 5,
    ) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        self.api_url = api_url
        self.topic_api_url = topic_api_url
        self.retry = retry or RetryPolicy()
        self.cache = cache
        self.maxlag = maxlag
        self.session = requests.Session()
        # max_retries=0: the retry loop below owns retrying (it also has to retry 200 responses
        # that carry a maxlag error or broken JSON, which urllib3's Retry cannot see).
        adapter = HTTPAdapter(pool_connections=4, pool_maxsize=max(concurrency, 1),
                              max_retries=0)
        self.session.mount("http://", adapter)
        self.session.mount("https://", adapter)
        self.session.headers.update({
            "User-Agent": user_agent or default_user_agent(),
            "Accept": "application/json",
            "Accept-Encoding": "gzip",
        })
        self.stop = threading.Event()  # set to make waiting retries give up early
        self._lock = threading.Lock()
        self._pause_until: dict[str, float] = {}
        self.stats = {"requests": 0, "cache_hits": 0, "retries": 0}

    def close(self) -> None:
        """Close the pooled connections."""
        self.session.close()

    def __enter__(self) -> WikiClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _count(self, name: str) -> None:
        with self._lock:
            self.stats[name] += 1

    # ---- one request, retried -------------------------------------------------------------

    def _sleep(self, seconds: float) -> None:
        if self.stop.wait(seconds):
            raise WikiError("stopped")

    def _wait_for_host(self, host: str) -> None:
        """Honour a Retry-After another thread received from this host."""
        with self._lock:
            until = self._pause_until.get(host, 0.0)
        now = time.monotonic()
        if until > now:
            self._sleep(until - now)

    def _pause_host(self, host: str, seconds: float) -> None:
        with self._lock:
            until = time.monotonic() + seconds
            self._pause_until[host] = max(self._pause_until.get(host, 0.0), until)

    def _attempt(self, method: str, url: str, params: dict[str, Any] | None,
                 body: Any) -> Any:
        try:
            resp = self.session.request(method, url, params=params, json=body,
                                        timeout=(min(self.retry.timeout, 10.0),
                                                 self.retry.timeout))
        except requests.ConnectTimeout:
            raise _Retryable("connection timed out", connect=True) from None
        except requests.Timeout:
            raise _Retryable(f"timed out after {self.retry.timeout:g}s") from None
        except requests.ConnectionError as exc:
            reason, connect = _describe_connection_error(exc)
            raise _Retryable(reason, connect=connect) from None
        except requests.RequestException as exc:  # invalid URL and the like: not retryable
            raise RequestFailed(_one_line(exc)) from None

        with resp:
            status = resp.status_code
            retry_after = parse_retry_after(resp.headers.get("Retry-After"))
            if status == 429 or status >= 500:
                raise _Retryable(f"HTTP {status}", retry_after)
            if status >= 400:
                raise RequestFailed(f"HTTP {status} from {url}: {_one_line(resp.text, 120)}")
            try:
                obj = resp.json()
            except ValueError:
                raise _Retryable("malformed JSON") from None
        if isinstance(obj, dict) and isinstance(obj.get("error"), dict):
            code = obj["error"].get("code")
            if code in ("maxlag", "ratelimited", "readonly", "internal_api_error_DBQueryError"):
                raise _Retryable(f"API error {code}", retry_after)
            raise RequestFailed(f"API error {code}: {_one_line(obj['error'])}")
        return obj

    def request_json(
        self,
        method: str,
        url: str,
        params: dict[str, Any] | None = None,
        body: Any = None,
        validate: Callable[[Any], Any] | None = None,
    ) -> Any:
        """Send one request (retried as :attr:`retry` says) and return its parsed JSON body.

        A cached response is returned without asking the server. A response is cached only
        after ``validate`` (if given) accepted it.

        Parameters
        ----------
        method : str
            ``"GET"`` or ``"POST"``.
        url : str
        params : dict or None, default None
            Query-string parameters.
        body : JSON-serialisable or None, default None
            Sent as a JSON body.
        validate : callable or None, default None
            Called with the parsed body; raises :class:`RequestFailed` to reject it (not
            retried, not cached).

        Raises
        ------
        ApiUnreachable
            If no attempt could connect.
        RequestFailed
            Out of retries, an HTTP 4xx other than 429, an API error, or ``validate`` refused.
        """
        key = None
        if self.cache is not None:
            key = ResponseCache.key(method, url, params, body)
            cached = self.cache.get(key)
            if cached is not None:
                try:
                    if validate is not None:
                        validate(cached)
                except RequestFailed:
                    cached = None  # a stale or foreign entry: fetch again
            if cached is not None:
                self._count("cache_hits")
                return cached

        host = urlsplit(url).netloc
        attempts = self.retry.retries + 1
        all_connect_failures = True
        reason = ""
        for attempt in range(attempts):
            if self.stop.is_set():  # the build is being aborted: send nothing new
                raise WikiError("stopped")
            self._wait_for_host(host)
            self._count("requests")
            try:
                obj = self._attempt(method, url, params, body)
            except _Retryable as exc:
                reason = exc.reason
                all_connect_failures = all_connect_failures and exc.connect
                if attempt + 1 == attempts:
                    break
                delay = self.retry.delay(attempt, exc.retry_after)
                if exc.retry_after is not None:
                    self._pause_host(host, delay)
                log.debug("%s %s: %s; retry %d/%d in %.2fs", method, url, reason, attempt + 1,
                          self.retry.retries, delay)
                self._count("retries")
                self._sleep(delay)
                continue
            if validate is not None:
                validate(obj)
            if key is not None:
                self.cache.put(key, obj)  # type: ignore[union-attr]
            return obj

        tries = f"{attempts} attempt{'s' if attempts > 1 else ''}"
        if all_connect_failures:
            raise ApiUnreachable(f"cannot reach {url}: {reason} ({tries})")
        raise RequestFailed(f"{reason} after {tries}")

    # ---- the Action API -------------------------------------------------------------------

    def query(self, params: dict[str, Any]) -> dict[str, Any]:
        """One ``action=query`` request (``format=json``, ``maxlag`` added)."""
        full = {"action": "query", "format": "json", **params}
        if self.maxlag is not None:
            full["maxlag"] = self.maxlag

        def check(obj: Any) -> None:
            if not isinstance(obj, dict):
                raise RequestFailed("API: response is not a JSON object")

        return self.request_json("GET", self.api_url, params=full, validate=check)

    def query_continued(self, params: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """Yield every response of a query, following ``continue`` until it is complete."""
        cont: dict[str, Any] = {}
        seen: set[str] = set()
        for _ in range(_MAX_CONTINUATIONS):
            resp = self.query({**params, **cont})
            yield resp
            nxt = resp.get("continue")
            if not isinstance(nxt, dict) or not nxt:
                return
            token = json.dumps(nxt, sort_keys=True)
            if token in seen:  # a server that repeats itself would loop forever
                raise RequestFailed(f"API repeated continuation {token}")
            seen.add(token)
            cont = {str(k): v for k, v in nxt.items()}
        raise RequestFailed(f"more than {_MAX_CONTINUATIONS} continuations")

    def fetch_extracts(self, titles: list[str]) -> dict[str, Page]:
        """Plain-text lead sections of up to :data:`MAX_TITLES_PER_QUERY` titles.

        Parameters
        ----------
        titles : list of str
            Titles as the user gave them (``_`` or lower-case first letters are fine).

        Returns
        -------
        dict of str to Page
            One entry per requested title; several may point at the same page.
        """
        if not titles:
            return {}
        if len(titles) > MAX_TITLES_PER_QUERY:
            raise ValueError(f"at most {MAX_TITLES_PER_QUERY} titles per query")
        params = {
            "prop": "extracts|info|pageprops",
            "exintro": 1,
            "explaintext": 1,
            "exsectionformat": "plain",
            "exlimit": min(len(titles), MAX_INTRO_EXTRACTS),
            "ppprop": "disambiguation",
            "redirects": 1,
            "titles": "|".join(titles),
        }
        renamed: dict[str, str] = {}  # normalized and converted (language variant) titles
        redirects: dict[str, str] = {}
        pages: dict[str, dict[str, Any]] = {}
        interwiki: set[str] = set()
        for resp in self.query_continued(params):
            query = resp.get("query")
            if not isinstance(query, dict):
                continue
            for kind in ("normalized", "converted"):
                for item in query.get(kind) or []:
                    if isinstance(item, dict) and "from" in item and "to" in item:
                        renamed[str(item["from"])] = str(item["to"])
            for item in query.get("redirects") or []:
                if isinstance(item, dict) and "from" in item and "to" in item:
                    redirects[str(item["from"])] = str(item["to"])
            for item in query.get("interwiki") or []:
                if isinstance(item, dict) and "title" in item:
                    interwiki.add(str(item["title"]))
            # Continuations repeat each page with only the properties still to come: merge.
            for page in _pages_of(query):
                merged = pages.setdefault(page["title"], {})
                merged.update({k: v for k, v in page.items() if v is not None})

        out: dict[str, Page] = {}
        for requested in titles:
            if requested in interwiki:
                out[requested] = Page(title=requested, invalid="interwiki title")
                continue
            title = renamed.get(requested, requested)
            was_normalized = title != requested
            hops = 0
            while title in redirects and hops < 5:  # the API resolves one hop; be lenient
                title, hops = redirects[title], hops + 1
            info = pages.get(title)
            if info is None:
                out[requested] = Page(title=title, missing=True, normalized=was_normalized,
                                      redirected=hops > 0)
                continue
            page = Page(title=title, normalized=was_normalized, redirected=hops > 0)
            if _flag(info, "invalid"):
                page.invalid = _one_line(info.get("invalidreason") or "invalid title")
            elif _flag(info, "special"):
                page.invalid = "special page"
            elif _flag(info, "missing"):
                page.missing = True
            else:
                page.pageid = _int_or_none(info.get("pageid"))
                page.revid = _int_or_none(info.get("lastrevid"))
                extract = info.get("extract")
                page.text = extract.strip() if isinstance(extract, str) else ""
                props = info.get("pageprops")
                page.disambiguation = isinstance(props, dict) and "disambiguation" in props
            out[requested] = page
        return out

    def random_titles(self, n: int, namespace: int = 0) -> list[str]:
        """``n`` distinct random article titles (redirects excluded), via ``list=random``."""
        found: list[str] = []
        seen: set[str] = set()
        cont: dict[str, Any] = {}
        for _ in range(_MAX_CONTINUATIONS):
            if len(found) >= n:
                break
            params = {"list": "random", "rnnamespace": namespace,
                      "rnfilterredir": "nonredirects",
                      "rnlimit": min(n - len(found), MAX_LIST_LIMIT), **cont}
            resp = self.query(params)
            items = (resp.get("query") or {}).get("random") or []
            for item in items:
                title = item.get("title") if isinstance(item, dict) else None
                if isinstance(title, str) and title not in seen:
                    seen.add(title)
                    found.append(title)
            nxt = resp.get("continue")
            if not items or not isinstance(nxt, dict):
                break
            cont = {str(k): v for k, v in nxt.items()}
        return found[:n]

    def category_titles(self, category: str, depth: int = 0) -> list[str]:
        """Article titles in a category and its subcategories down to ``depth`` levels.

        Parameters
        ----------
        category : str
            With or without the ``Category:`` prefix.
        depth : int, default 0
            0: the category's own articles; 1: also those of its subcategories; and so on.

        Returns
        -------
        list of str
            Main-namespace titles, breadth first, without duplicates.
        """
        if depth < 0:
            raise ValueError(f"depth must be >= 0, got {depth}")
        name = category.strip()
        if not name.lower().startswith("category:"):
            name = f"Category:{name}"
        titles: list[str] = []
        seen_titles: set[str] = set()
        seen_cats = {name}
        level = [name]
        for d in range(depth + 1):
            next_level: list[str] = []
            for cat in level:
                params = {"list": "categorymembers", "cmtitle": cat,
                          "cmtype": "page|subcat" if d < depth else "page",
                          "cmnamespace": "0|14" if d < depth else "0",
                          "cmlimit": MAX_LIST_LIMIT}
                for resp in self.query_continued(params):
                    for item in (resp.get("query") or {}).get("categorymembers") or []:
                        if not isinstance(item, dict) or not isinstance(item.get("title"), str):
                            continue
                        title, ns = item["title"], item.get("ns")
                        if ns == 0 and title not in seen_titles:
                            seen_titles.add(title)
                            titles.append(title)
                        elif ns == 14 and d < depth and title not in seen_cats:
                            seen_cats.add(title)
                            next_level.append(title)
            level = next_level
        return titles

    # ---- Lift Wing -------------------------------------------------------------------------

    def topic_scores(self, revid: int) -> dict[str, float]:
        """All 64 ``articletopic`` probabilities of revision ``revid``."""
        return parse_topic_scores(
            self.request_json("POST", self.topic_api_url, body={"rev_id": revid},
                              validate=lambda obj: parse_topic_scores(obj, revid)),
            revid,
        )


# --------------------------------------------------------------------------------------------
# Reading titles
# --------------------------------------------------------------------------------------------


def clean_title(raw: str) -> str | None:
    """A title from a line of user input; None if nothing is left.

    Accepts plain titles and article URLs (``https://en.wikipedia.org/wiki/Foo_bar``,
    ``...index.php?title=Foo``); drops a ``#section`` fragment and surrounding blanks.
    Underscores are left for the API to normalize.
    """
    text = raw.strip()
    if text.startswith(("http://", "https://")):
        parts = urlsplit(text)
        if "/wiki/" in parts.path:
            text = unquote(parts.path.split("/wiki/", 1)[1])
        else:
            query = dict(p.split("=", 1) for p in parts.query.split("&") if "=" in p)
            text = unquote(query.get("title", "").replace("+", " "))
    text = text.split("#", 1)[0].strip()
    return text or None


def dedupe(titles: Iterable[str]) -> list[str]:
    """Titles without repeats, first occurrence kept."""
    return list(dict.fromkeys(titles))


def _read_text(path: str | Path) -> str:
    p = Path(path)
    try:
        return p.read_text(encoding="utf-8-sig")  # -sig: tolerate a BOM from spreadsheet tools
    except FileNotFoundError:
        raise DataError(f"{p}: no such file") from None
    except IsADirectoryError:
        raise DataError(f"{p}: is a directory, not a file") from None
    except PermissionError:
        raise DataError(f"{p}: permission denied") from None
    except UnicodeDecodeError as exc:
        raise DataError(f"{p}: not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise DataError(f"{p}: cannot read ({exc.strerror or exc})") from None


def read_titles(path: str | Path) -> list[str]:
    """Titles from a file with one title (or article URL) per line.

    Blank lines and lines starting with ``#`` are skipped; duplicates are removed, keeping the
    first occurrence.

    Raises
    ------
    DataError
        If the file cannot be read, is not UTF-8, or holds no title.
    """
    titles = []
    for line in _read_text(path).splitlines():
        if line.lstrip().startswith("#"):
            continue
        title = clean_title(line)
        if title:
            titles.append(title)
    if not titles:
        raise DataError(f"{path}: no titles")
    return dedupe(titles)


_HEADER_WORDS = {"title", "page", "article", "timestamp", "time", "date", "datetime", "viewed",
                 "viewed_at", "visited", "visit_time"}


def read_history(path: str | Path) -> list[str]:
    """Titles from a viewing-history export, in file order, without duplicates.

    Each line is ``title<TAB>timestamp`` or CSV ``title,timestamp`` (quoted or not: the last
    comma separates the timestamp); a first line of column names (``title,timestamp``) is
    skipped. The title may also be an article URL. Timestamps are not interpreted.

    Raises
    ------
    DataError
        If the file cannot be read, a line has no timestamp field (``file:line: ...``), or no
        title is found.
    """
    text = _read_text(path)
    titles: list[str] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        if "\t" in line:
            fields = line.rsplit("\t", 1)
        else:
            row = next(csv.reader(io.StringIO(line)), [])
            fields = [",".join(row[:-1]), row[-1]] if len(row) >= 2 else row
        if len(fields) != 2 or not fields[0].strip():
            raise DataError(f"{path}:{lineno}: expected 'title<TAB>timestamp' or "
                            "'title,timestamp'")
        if lineno == 1 and (fields[0].strip().lower() in _HEADER_WORDS
                            or fields[1].strip().lower() in _HEADER_WORDS):
            continue
        title = clean_title(fields[0])
        if title:
            titles.append(title)
    if not titles:
        raise DataError(f"{path}: no titles")
    return dedupe(titles)


# --------------------------------------------------------------------------------------------
# Building the dataset
# --------------------------------------------------------------------------------------------


@dataclass
class BuildResult:
    """Everything :func:`build_dataset` learnt.

    Attributes
    ----------
    rows : list of dict
        ``{title, pageid, revid, text, topics, label}`` per article, in the order of the first
        input title that led to it.
    missing : dict of str to str
        Input title -> why there is no page (``"missing"`` or the invalid-title reason).
    disambiguation : list of str
        Input titles that are disambiguation pages (left out of ``rows``).
    empty : list of str
        Input titles whose page has no lead text (left out).
    duplicates : dict of str to str
        Input title -> the earlier input title that reached the same page.
    failed : dict of str to str
        Input title -> why it could not be fetched or scored.
    normalized, redirected : int
        How many input titles the API normalized / redirected.
    requested : int
    topic : str
    threshold : float
    elapsed : float
        Seconds.
    stats : dict
        The client's request, cache-hit and retry counts.
    """

    rows: list[dict[str, Any]] = field(default_factory=list)
    missing: dict[str, str] = field(default_factory=dict)
    disambiguation: list[str] = field(default_factory=list)
    empty: list[str] = field(default_factory=list)
    duplicates: dict[str, str] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    normalized: int = 0
    redirected: int = 0
    requested: int = 0
    topic: str = DEFAULT_TOPIC
    threshold: float = 0.5
    elapsed: float = 0.0
    stats: dict[str, int] = field(default_factory=dict)

    @property
    def label_balance(self) -> dict[int, int]:
        """Number of rows with label 0 and with label 1."""
        ones = sum(row["label"] for row in self.rows)
        return {0: len(self.rows) - ones, 1: ones}

    def summary(self) -> dict[str, Any]:
        """A JSON-ready summary."""
        balance = self.label_balance
        return {
            "requested": self.requested,
            "fetched": len(self.rows),
            "missing": len(self.missing),
            "disambiguation": len(self.disambiguation),
            "empty": len(self.empty),
            "duplicates": len(self.duplicates),
            "failed": len(self.failed),
            "normalized": self.normalized,
            "redirected": self.redirected,
            "topic": self.topic,
            "threshold": self.threshold,
            "label_balance": {"0": balance[0], "1": balance[1]},
            "elapsed_s": round(self.elapsed, 3),
            "requests": dict(self.stats),
            "missing_titles": dict(self.missing),
            "disambiguation_titles": list(self.disambiguation),
            "empty_titles": list(self.empty),
            "failed_titles": dict(self.failed),
        }


def _batches(items: list[str], size: int) -> Iterator[list[str]]:
    for i in range(0, len(items), size):
        yield items[i:i + size]


def build_dataset(
    titles: list[str],
    client: WikiClient,
    topic: str = DEFAULT_TOPIC,
    threshold: float = 0.5,
    batch_size: int = MAX_INTRO_EXTRACTS,
    concurrency: int = 4,
    progress: Callable[[int], None] | None = None,
) -> BuildResult:
    """Fetch, score and label every title.

    Extract batches and per-article topic requests share one pool of ``concurrency`` threads;
    an article's topic request is queued as soon as its batch arrives.

    Parameters
    ----------
    titles : list of str
        Input titles (duplicates are fetched once).
    client : WikiClient
    topic : str, default "STEM.Technology"
        One of the 64 articletopic labels; ``label`` is 1 when its probability >= ``threshold``.
    threshold : float, default 0.5
    batch_size : int, default 20
        Titles per extracts request, 1 to 50 (above 20 the API needs continuation requests).
    concurrency : int, default 4
        Requests in flight at most.
    progress : callable or None, default None
        Called with the number of input titles just finished (summing to ``len(titles)``).

    Returns
    -------
    BuildResult

    Raises
    ------
    ValueError
        Bad ``topic``, ``threshold``, ``batch_size`` or ``concurrency``.
    ApiUnreachable
        If an endpoint cannot be reached at all; the pool is stopped first.
    """
    topic = check_topic(topic)
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"threshold must be between 0 and 1, got {threshold}")
    if not 1 <= batch_size <= MAX_TITLES_PER_QUERY:
        raise ValueError(f"batch size must be between 1 and {MAX_TITLES_PER_QUERY}, "
                         f"got {batch_size}")
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")

    started = time.monotonic()
    titles = dedupe(titles)
    result = BuildResult(requested=len(titles), topic=topic, threshold=threshold)
    order = {t: i for i, t in enumerate(titles)}
    tick = progress or (lambda n: None)

    valid: list[str] = []
    for title in titles:
        if _BAD_TITLE_CHARS.search(title) or len(title.encode("utf-8")) > 255:
            result.missing[title] = "invalid title"
            tick(1)
        else:
            valid.append(title)

    # All keyed by page id, since several input titles may reach one page.
    by_pageid: dict[int, str] = {}        # the first input title (in input order) reaching it
    waiting: dict[int, list[str]] = {}    # input titles waiting for its topic scores
    scored: set[int] = set()              # pages whose scores arrived
    page_failed: dict[int, str] = {}      # pages whose scores could not be had, and why
    rows: dict[int, dict[str, Any]] = {}
    pages: dict[int, Page] = {}

    client.stop.clear()
    pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="wiki")
    pending: dict[Future, tuple[str, Any]] = {}
    try:
        for batch in _batches(valid, batch_size):
            pending[pool.submit(client.fetch_extracts, batch)] = ("extracts", batch)
        while pending:
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for fut in done:
                kind, what = pending.pop(fut)
                try:
                    value = fut.result()
                except ApiUnreachable:
                    raise
                except WikiError as exc:
                    if kind == "extracts":
                        names = what
                    else:
                        names = waiting.pop(what, [])
                        page_failed[what] = str(exc)
                    for title in names:
                        result.failed[title] = str(exc)
                    tick(len(names))
                    continue

                if kind == "topics":
                    pageid, page = what, pages[what]
                    prob = value.get(topic)
                    names = waiting.pop(pageid, [])
                    if prob is None:
                        page_failed[pageid] = f"topic API: no score for {topic}"
                        for title in names:
                            result.failed[title] = page_failed[pageid]
                    else:
                        rows[pageid] = {
                            "title": page.title, "pageid": page.pageid, "revid": page.revid,
                            "text": page.text, "topics": value, "label": int(prob >= threshold),
                        }
                        scored.add(pageid)
                    tick(len(names))
                    continue

                for requested, page in value.items():
                    result.normalized += page.normalized
                    result.redirected += page.redirected
                    if page.invalid:
                        result.missing[requested] = page.invalid
                    elif page.missing:
                        result.missing[requested] = "missing"
                    elif page.disambiguation:
                        result.disambiguation.append(requested)
                    elif not page.text:
                        result.empty.append(requested)
                    elif page.pageid is None or page.revid is None:
                        result.failed[requested] = "API gave no page id or revision id"
                    elif page.pageid in by_pageid:
                        pid, first = page.pageid, by_pageid[page.pageid]
                        if order[requested] < order[first]:  # rows follow input order
                            by_pageid[pid] = requested
                            result.duplicates[first] = requested
                        else:
                            result.duplicates[requested] = first
                        if pid in page_failed:
                            result.failed[requested] = page_failed[pid]
                        elif pid not in scored:
                            waiting[pid].append(requested)
                            continue  # ticked when the page is scored
                    else:
                        by_pageid[page.pageid] = requested
                        pages[page.pageid] = page
                        waiting[page.pageid] = [requested]
                        fut2 = pool.submit(client.topic_scores, page.revid)
                        pending[fut2] = ("topics", page.pageid)
                        continue
                    tick(1)
    except BaseException:
        client.stop.set()  # waiting retries give up, queued work is dropped
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)

    result.rows = [rows[pid] for pid in sorted(rows, key=lambda pid: order[by_pageid[pid]])]
    result.disambiguation.sort(key=order.__getitem__)
    result.empty.sort(key=order.__getitem__)
    result.missing = dict(sorted(result.missing.items(), key=lambda kv: order[kv[0]]))
    result.failed = dict(sorted(result.failed.items(), key=lambda kv: order[kv[0]]))
    result.elapsed = time.monotonic() - started
    result.stats = dict(client.stats)
    return result


def write_jsonl(path: str | Path, rows: Iterable[dict[str, Any]]) -> None:
    """Write ``rows`` as JSON Lines (UTF-8, one object a line) atomically.

    The file appears complete or not at all; an existing file is replaced only on success.
    """
    data = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    atomic_write_bytes(path, data.encode("utf-8"))
