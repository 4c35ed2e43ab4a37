"""HTTP client of the MediaWiki Action API and Wikimedia's Lift Wing inference API.

Requests run over one ``requests.Session`` shared by the build's threads. Each is retried with
exponential back-off and full jitter on HTTP 429 and 5xx, time-outs, dropped connections,
malformed JSON and MediaWiki's ``maxlag`` error, honouring ``Retry-After`` (which also pauses
the other threads talking to that host). Successful responses go to an optional
:class:`~fedctl.datasets.wikipedia.cache.ResponseCache`.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

import requests
from requests.adapters import HTTPAdapter

from fedctl.datasets.wikipedia.cache import ResponseCache
from fedctl.datasets.wikipedia.errors import ApiUnreachable, RequestFailed, WikiError, one_line
from fedctl.datasets.wikipedia.pages import ExtractsAnswer, Page, parse_topic_scores
from fedctl.datasets.wikipedia.retry import RetryPolicy, parse_retry_after

__all__ = [
    "DEFAULT_API_URL",
    "DEFAULT_TOPIC_API_URL",
    "MAX_TITLES_PER_QUERY",
    "MAX_INTRO_EXTRACTS",
    "MAX_LIST_LIMIT",
    "WikiClient",
    "default_user_agent",
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

_MAX_CONTINUATIONS = 1000


class _Retryable(Exception):
    """Internal: one attempt failed in a way worth retrying."""

    def __init__(self, reason: str, retry_after: float | None = None,
                 connect: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry_after = retry_after
        self.connect = connect


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
    return f"connection error: {one_line(text, 120)}", False


def _extracts_params(titles: list[str]) -> dict[str, Any]:
    """The ``action=query`` parameters asking for the plain-text leads of ``titles``."""
    return {
        "prop": "extracts|info|pageprops",
        "exintro": 1,
        "explaintext": 1,
        "exsectionformat": "plain",
        "exlimit": min(len(titles), MAX_INTRO_EXTRACTS),
        "ppprop": "disambiguation",
        "redirects": 1,
        "titles": "|".join(titles),
    }


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
            raise RequestFailed(one_line(exc)) from None

        with resp:
            status = resp.status_code
            retry_after = parse_retry_after(resp.headers.get("Retry-After"))
            if status == 429 or status >= 500:
                raise _Retryable(f"HTTP {status}", retry_after)
            if status >= 400:
                raise RequestFailed(f"HTTP {status} from {url}: {one_line(resp.text, 120)}")
            try:
                obj = resp.json()
            except ValueError:
                raise _Retryable("malformed JSON") from None
        if isinstance(obj, dict) and isinstance(obj.get("error"), dict):
            code = obj["error"].get("code")
            if code in ("maxlag", "ratelimited", "readonly", "internal_api_error_DBQueryError"):
                raise _Retryable(f"API error {code}", retry_after)
            raise RequestFailed(f"API error {code}: {one_line(obj['error'])}")
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
            cached = self._from_cache(self.cache, key, validate)
            if cached is not None:
                return cached
        obj = self._send(method, url, params, body)
        if validate is not None:
            validate(obj)
        if key is not None:
            self.cache.put(key, obj)  # type: ignore[union-attr]
        return obj

    def _from_cache(self, cache: ResponseCache, key: str,
                    validate: Callable[[Any], Any] | None) -> Any | None:
        """The body cached under ``key`` if there is one and ``validate`` accepts it."""
        cached = cache.get(key)
        if cached is None:
            return None
        if validate is not None:
            try:
                validate(cached)
            except RequestFailed:
                return None  # a stale or foreign entry: fetch again
        self._count("cache_hits")
        return cached

    def _send(self, method: str, url: str, params: dict[str, Any] | None, body: Any) -> Any:
        """The parsed body of the first attempt that succeeds, retrying as :attr:`retry` says.

        Raises
        ------
        ApiUnreachable
            If no attempt could connect.
        RequestFailed
            Out of retries, or a failure not worth retrying (HTTP 4xx, an API error).
        WikiError
            ``"stopped"``: :attr:`stop` was set while waiting.
        """
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
                return self._attempt(method, url, params, body)
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
        answer = ExtractsAnswer()
        for resp in self.query_continued(_extracts_params(titles)):
            answer.add(resp.get("query"))
        return {requested: answer.page_for(requested) for requested in titles}

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
