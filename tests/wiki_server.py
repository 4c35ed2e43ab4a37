"""A loopback stand-in for the MediaWiki Action API and Lift Wing, with fault injection.

Used by tests/test_wikipedia.py and benchmarks/wikipedia_fetch.py. A real
``http.server.ThreadingHTTPServer`` on 127.0.0.1 (port 0) in a background thread answers

* ``GET /w/api.php?action=query&...``: ``titles=`` with ``prop=extracts|info|pageprops``
  (normalization, redirects, missing and invalid titles, disambiguation ``pageprops``,
  ``exlimit`` and ``excontinue`` continuation), ``list=random`` (``rncontinue``) and
  ``list=categorymembers`` (``cmtype``, ``cmnamespace``, ``cmcontinue``), in the
  ``format=json`` (formatversion 1) shape of the recorded responses in
  ``tests/fixtures/wikipedia``;
* ``POST /lw/inference/v1/models/enwiki-articletopic:predict`` with ``{"rev_id": N}``: the
  Lift Wing response shape with all 64 labels' probabilities (deterministic per revision, or
  set per page).

Run as ``python -m tests.wiki_server [--latency S] [--synthetic N]`` it serves in its own
process (so that a benchmark's client and server do not share one interpreter lock), prints
``{"url": ..., "topic_url": ...}`` on one line and runs until stdin closes.

The page table is built from the recorded responses (Python (programming language), Douglas
Adams and its disambiguation page and redirects, the random and Physics category members) plus
whatever a test adds. Faults (status codes with ``Retry-After``, slow responses, malformed
JSON, ``maxlag`` errors) are queued with :meth:`WikiServer.add_fault`; every request is
logged and counted, and the most requests ever in flight at once is recorded.
"""

from __future__ import annotations

import csv
import hashlib
import json
import re
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "wikipedia"
API_PATH = "/w/api.php"
TOPIC_PATH = "/lw/inference/v1/models/enwiki-articletopic:predict"
STATS_PATH = "/_stats"  # GET: {"requests", "max_inflight"} (not counted as requests)
RESET_PATH = "/_reset"  # POST: forget the log, the maximum and the faults
TITLE_LIMIT = 50  # titles= values per request for a normal client
_BAD_CHARS = re.compile(r"[<>\[\]{}|#]")


def load_fixture(name: str) -> dict[str, Any]:
    """The recorded response body (``"response"``) of ``tests/fixtures/wikipedia/<name>``."""
    return json.loads((FIXTURES / name).read_text(encoding="utf-8"))["response"]


def topic_labels() -> list[str]:
    """The 64 articletopic labels, from the fixture TSV (not from the code under test)."""
    with (FIXTURES / "enwiki_articletopic_labels.tsv").open(encoding="utf-8") as fh:
        return [row["label"] for row in csv.DictReader(fh, delimiter="\t")]


@dataclass
class WikiPage:
    """One article the server knows.

    Attributes
    ----------
    title : str
    pageid, revid : int
    text : str
        The lead section as plain text (served with ``exintro``).
    full_text : str or None
        The whole article (served without ``exintro``); None means ``text``.
    disambiguation : bool
    topics : dict of str to float
        Probabilities that override the deterministic ones.
    """

    title: str
    pageid: int
    revid: int
    text: str
    full_text: str | None = None
    disambiguation: bool = False
    topics: dict[str, float] = field(default_factory=dict)


def _strip_html(html: str) -> str:
    text = re.sub(r"</(p|li)>", "\n", html)
    return re.sub(r"<[^>]+>", "", text).strip()


def fixture_pages() -> tuple[dict[str, WikiPage], dict[str, str]]:
    """Pages and redirects built from the recorded responses.

    Returns
    -------
    pages : dict of title to WikiPage
    redirects : dict of redirect title to target title
    """
    pages: dict[str, WikiPage] = {}

    full = load_fixture("wikipediaapi_query_extracts_explaintext_Python.json")
    py = full["query"]["pages"]["23862"]
    info = load_fixture("wikipediaapi_query_info_Python.json")["query"]["pages"]["23862"]
    lead = re.split(r"\n+== ", py["extract"], maxsplit=1)[0].strip()
    pages[py["title"]] = WikiPage(py["title"], py["pageid"], info["lastrevid"], lead,
                                  full_text=py["extract"],
                                  topics={"STEM.Technology": 0.93, "STEM.Computing": 0.98,
                                          "Culture.Literature": 0.02})

    adams = load_fixture("wptools_query_extracts_html_fv2_Douglas_Adams.json")["query"]["pages"][0]
    summary = load_fixture("wptools_rest_v1_page_summary_Douglas_Adams.json")
    pages[adams["title"]] = WikiPage(adams["title"], adams["pageid"], adams["lastrevid"],
                                     summary["extract"],
                                     topics={"STEM.Technology": 0.04,
                                             "Culture.Biography.Biography*": 0.97,
                                             "Culture.Literature": 0.91})
    redirects = {r["title"]: adams["title"] for r in adams["redirects"] if r["ns"] == 0}

    dis = load_fixture("wptools_query_extracts_html_fv2_disambiguation.json")["query"]["pages"][0]
    pages[dis["title"]] = WikiPage(dis["title"], dis["pageid"], dis["lastrevid"],
                                   _strip_html(dis["extract"]), disambiguation=True)

    for item in load_fixture("wikipediaapi_query_random_3.json")["query"]["random"]:
        pages[item["title"]] = _made_up(item["title"], item["id"])
    physics = load_fixture("wikipediaapi_query_categorymembers_Physics.json")
    for item in physics["query"]["categorymembers"]:
        if item["ns"] == 0:
            pages[item["title"]] = _made_up(item["title"], item["pageid"])
    return pages, redirects


def _made_up(title: str, pageid: int) -> WikiPage:
    return WikiPage(title, pageid, 1_000_000_000 + pageid,
                    f"{title} is an article of the loopback test wiki (page {pageid}).")


def synthetic_pages(n: int, prefix: str = "Article") -> dict[str, WikiPage]:
    """``n`` made-up pages ``"<prefix> 00001"`` ... with page ids from 10,000,001."""
    return {p.title: p for p in (_made_up(f"{prefix} {i:05d}", 10_000_001 + i)
                                 for i in range(n))}


def fixture_categories() -> dict[str, list[dict[str, Any]]]:
    """``Category:Physics`` as recorded, and two of its subcategories with made-up members."""
    physics = load_fixture("wikipediaapi_query_categorymembers_Physics.json")
    return {
        "Category:Physics": physics["query"]["categorymembers"],
        "Category:Subfields of physics": [
            {"pageid": 5_000_001, "ns": 0, "title": "Acoustics"},
            {"pageid": 22939, "ns": 0, "title": "Physics"},  # also a member of the parent
            {"pageid": 5_000_003, "ns": 14, "title": "Category:Optics"},
        ],
        "Category:Optics": [{"pageid": 5_000_004, "ns": 0, "title": "Lens"}],
    }


@dataclass
class Fault:
    """A misbehaviour applied to the next ``times`` matching requests.

    Attributes
    ----------
    kind : str, default "any"
        ``"api"``, ``"topics"`` or ``"any"``.
    times : int, default 1
        How many requests it hits; -1 for all.
    status : int or None, default None
        Answer with this HTTP status (and a small error body).
    retry_after : str or None, default None
        ``Retry-After`` header value sent with ``status`` or ``maxlag``.
    delay : float, default 0.0
        Sleep this long before answering (normally, unless another action is set).
    malformed : bool, default False
        Answer 200 with truncated JSON.
    maxlag : bool, default False
        Answer 200 with MediaWiki's ``maxlag`` error.
    when : callable or None, default None
        ``when(record) -> bool`` on the request record; None matches every request of ``kind``.
    hits : int
        How many requests it hit so far.
    """

    kind: str = "any"
    times: int = 1
    status: int | None = None
    retry_after: str | None = None
    delay: float = 0.0
    malformed: bool = False
    maxlag: bool = False
    when: Callable[[dict[str, Any]], bool] | None = None
    hits: int = 0


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 512  # 64 clients connecting at once must not be refused

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that timed out and hung up is part of the tests, not an error


class WikiServer:
    """The loopback server. Use as a context manager, or call :meth:`start` and :meth:`stop`.

    Parameters
    ----------
    pages : dict of title to WikiPage or None, default None
        None: :func:`fixture_pages`. Extra pages can be added to :attr:`pages` at any time.
    redirects : dict or None, default None
        None: the fixture's redirects.
    categories : dict or None, default None
        None: :func:`fixture_categories`.
    latency : float, default 0.0
        Seconds every request waits before it is answered.
    extract_limit : int, default 20
        Most extracts per response (the API's ``exlimit`` maximum with ``exintro``).
    list_limit : int, default 500
        Most entries per ``list=`` response.

    Attributes
    ----------
    url, topic_url : str
        The Action API and the Lift Wing endpoint.
    log : list of dict
        ``{"kind", "params", "body", "headers", "t"}`` of every request, in arrival order.
    max_inflight : int
        The most requests that were being handled at the same time.
    """

    def __init__(self, pages: dict[str, WikiPage] | None = None,
                 redirects: dict[str, str] | None = None,
                 categories: dict[str, list[dict[str, Any]]] | None = None,
                 latency: float = 0.0, extract_limit: int = 20, list_limit: int = 500) -> None:
        fx_pages, fx_redirects = fixture_pages()
        self.pages = dict(fx_pages if pages is None else pages)
        self.redirects = dict(fx_redirects if redirects is None else redirects)
        self.categories = fixture_categories() if categories is None else dict(categories)
        if pages is None:  # the made-up category members are articles too
            for members in self.categories.values():
                for m in members:
                    if m["ns"] == 0 and m["title"] not in self.pages:
                        self.pages[m["title"]] = _made_up(m["title"], m["pageid"])
        self.latency = latency
        self.extract_limit = extract_limit
        self.list_limit = list_limit
        self.labels = topic_labels()
        self.random_titles = [i["title"] for i in
                              load_fixture("wikipediaapi_query_random_3.json")["query"]["random"]]
        self.faults: list[Fault] = []
        self.log: list[dict[str, Any]] = []
        self.max_inflight = 0
        self._inflight = 0
        self._lock = threading.Lock()
        self._httpd: _Server | None = None
        self._thread: threading.Thread | None = None
        self.url = self.topic_url = ""

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self) -> WikiServer:
        handler = type("Handler", (_Handler,), {"wiki": self})
        self._httpd = _Server(("127.0.0.1", 0), handler)
        host, port = self._httpd.server_address[:2]
        self.url = f"http://{host}:{port}{API_PATH}"
        self.topic_url = f"http://{host}:{port}{TOPIC_PATH}"
        self._thread = threading.Thread(target=self._httpd.serve_forever,
                                        kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def __enter__(self) -> WikiServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- knobs and counters ------------------------------------------------------------------

    def add_fault(self, **kwargs: Any) -> Fault:
        """Queue a :class:`Fault` (keyword arguments as its attributes); faults match in order."""
        fault = Fault(**kwargs)
        with self._lock:
            self.faults.append(fault)
        return fault

    def count(self, kind: str | None = None) -> int:
        """Requests received (of one kind: ``"api"`` or ``"topics"``)."""
        with self._lock:
            return sum(1 for r in self.log if kind is None or r["kind"] == kind)

    def reset(self) -> None:
        """Forget the log, the in-flight maximum and all faults."""
        with self._lock:
            self.log.clear()
            self.faults.clear()
            self.max_inflight = 0

    def add_page(self, title: str, text: str, **kwargs: Any) -> WikiPage:
        """Add (or replace) a page; page and revision ids are made up unless given."""
        pageid = kwargs.pop("pageid", 20_000_000 + len(self.pages))
        page = WikiPage(title, pageid, kwargs.pop("revid", 1_000_000_000 + pageid), text,
                        **kwargs)
        self.pages[title] = page
        return page

    def _enter(self, record: dict[str, Any]) -> Fault | None:
        with self._lock:
            self.log.append(record)
            self._inflight += 1
            self.max_inflight = max(self.max_inflight, self._inflight)
            for fault in self.faults:
                if fault.kind not in ("any", record["kind"]):
                    continue
                if fault.times != -1 and fault.hits >= fault.times:
                    continue
                if fault.when is not None and not fault.when(record):
                    continue
                fault.hits += 1
                return fault
        return None

    def _leave(self) -> None:
        with self._lock:
            self._inflight -= 1

    # ---- the Action API ----------------------------------------------------------------------

    @staticmethod
    def normalize(title: str) -> str | None:
        """MediaWiki's title normalization (underscores, blanks, first letter); None: invalid."""
        text = " ".join(title.replace("_", " ").split())
        if not text or _BAD_CHARS.search(text):
            return None
        return text[0].upper() + text[1:]

    def api(self, params: dict[str, str]) -> dict[str, Any]:
        if params.get("action") != "query":
            return {"error": {"code": "badvalue", "info": "Unrecognized value for action."}}
        out: dict[str, Any] = {}
        query: dict[str, Any] = {}
        if "titles" in params:
            titles = params["titles"].split("|")
            if len(titles) > TITLE_LIMIT:
                return {"error": {"code": "toomanyvalues",
                                  "info": f'Too many values supplied for parameter "titles". '
                                          f"The limit is {TITLE_LIMIT}."}}
            self._titles(titles, params, out, query)
        if params.get("list") == "random":
            self._random(params, out, query)
        if params.get("list") == "categorymembers":
            self._categorymembers(params, out, query)
        if "continue" not in out:
            out["batchcomplete"] = ""
        out["query"] = query
        return out

    def _titles(self, titles: list[str], params: dict[str, str], out: dict[str, Any],
                query: dict[str, Any]) -> None:
        props = set(params.get("prop", "").split("|"))
        normalized: list[dict[str, str]] = []
        redirects: list[dict[str, str]] = []
        found: dict[str, WikiPage] = {}
        pages: dict[str, dict[str, Any]] = {}
        missing_id = 0
        for raw in titles:
            title = self.normalize(raw)
            if title is None:
                missing_id -= 1
                pages[str(missing_id)] = {"title": raw, "invalidreason":
                                          "The requested page title contains invalid "
                                          "characters.", "invalid": ""}
                continue
            if title != raw and {"from": raw, "to": title} not in normalized:
                normalized.append({"from": raw, "to": title})
            if "redirects" in params and title in self.redirects:
                if {"from": title, "to": self.redirects[title]} not in redirects:
                    redirects.append({"from": title, "to": self.redirects[title]})
                title = self.redirects[title]
            page = self.pages.get(title)
            if page is not None:
                found[title] = page
            elif not any(p.get("title") == title for p in pages.values()):
                missing_id -= 1
                pages[str(missing_id)] = {"ns": 0, "title": title, "missing": ""}
        continuing = "excontinue" in params
        with_extract: set[str] = set()
        if "extracts" in props:
            # Like the API: without exintro only one extract per request.
            limit = min(int(params.get("exlimit", 20)), self.extract_limit)
            if "exintro" not in params:
                limit = 1
            ordered = sorted(found)
            start = int(params.get("excontinue", 0))
            with_extract = set(ordered[start:start + limit])
            if start + limit < len(ordered):
                done = "||" if continuing else "||" + "|".join(sorted(props - {"extracts"}))
                out["continue"] = {"excontinue": start + limit, "continue": done}
        for title, page in found.items():
            obj: dict[str, Any] = {"pageid": page.pageid, "ns": 0, "title": title}
            if "info" in props and not continuing:
                obj.update({"contentmodel": "wikitext", "pagelanguage": "en",
                            "touched": "2026-03-27T09:26:22Z", "lastrevid": page.revid,
                            "length": len(page.full_text or page.text)})
            if ("pageprops" in props and not continuing and page.disambiguation
                    and "disambiguation" in params.get("ppprop", "disambiguation")):
                obj["pageprops"] = {"disambiguation": ""}
            if title in with_extract:
                text = page.text if "exintro" in params else (page.full_text or page.text)
                obj["extract"] = text if "explaintext" in params else f"<p>{text}</p>"
            pages[str(page.pageid)] = obj
        if normalized:
            query["normalized"] = normalized
        if redirects:
            query["redirects"] = redirects
        query["pages"] = pages

    def _random(self, params: dict[str, str], out: dict[str, Any],
                query: dict[str, Any]) -> None:
        # The recorded draw first, then made-up titles (added to the page table on the way).
        limit = min(int(params.get("rnlimit", 1)), self.list_limit)
        start = int(params.get("rncontinue", "0|0").split("|")[0])
        titles = []
        for i in range(start, start + limit):
            if i < len(self.random_titles):
                titles.append(self.random_titles[i])
            else:
                page = _made_up(f"Random page {i:05d}", 30_000_000 + i)
                self.pages.setdefault(page.title, page)
                titles.append(page.title)
        query["random"] = [{"id": self.pages[t].pageid, "ns": 0, "title": t} for t in titles]
        out["continue"] = {"rncontinue": f"{start + limit}|0", "continue": "-||"}

    def _categorymembers(self, params: dict[str, str], out: dict[str, Any],
                         query: dict[str, Any]) -> None:
        members = self.categories.get(params.get("cmtitle", ""), [])
        types = set(params.get("cmtype", "page|subcat|file").split("|"))
        if "cmnamespace" in params:
            spaces = {int(n) for n in params["cmnamespace"].split("|")}
            members = [m for m in members if m["ns"] in spaces]
        members = [m for m in members
                   if ("subcat" in types if m["ns"] == 14 else
                       "file" in types if m["ns"] == 6 else "page" in types)]
        limit = min(int(params.get("cmlimit", 10)), self.list_limit)
        start = int(params.get("cmcontinue", "page|0").split("|")[1])
        query["categorymembers"] = members[start:start + limit]
        if start + limit < len(members):
            out["continue"] = {"cmcontinue": f"page|{start + limit}", "continue": "-||"}

    # ---- Lift Wing ---------------------------------------------------------------------------

    def probabilities(self, page: WikiPage) -> dict[str, float]:
        """All 64 probabilities of a page: its ``topics``, else a hash of revid and label."""
        out = {}
        for label in self.labels:
            if label in page.topics:
                out[label] = page.topics[label]
            else:
                digest = hashlib.sha256(f"{page.revid}:{label}".encode()).digest()
                out[label] = round(int.from_bytes(digest[:4], "big") / 2**32, 3)
        return out

    def topics(self, body: Any) -> tuple[int, dict[str, Any]]:
        revid = body.get("rev_id") if isinstance(body, dict) else None
        page = next((p for p in self.pages.values() if p.revid == revid), None)
        if page is None:
            return 400, {"error": f"The MW API does not have any info related to the rev-id "
                                  f"provided as input ({revid})"}
        probs = self.probabilities(page)
        return 200, {"enwiki": {
            "models": {"articletopic": {"version": "1.3.0"}},
            "scores": {str(revid): {"articletopic": {"score": {
                "prediction": [lab for lab, p in probs.items() if p > 0.5],
                "probability": probs,
            }}}},
        }}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as a real API server offers
    # One send() per response: headers and body written separately would meet Nagle's
    # algorithm and the client's delayed ACK, adding ~40 ms to every request.
    wbufsize = 1 << 16
    disable_nagle_algorithm = True
    wiki: WikiServer

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - base signature
        pass

    def _send(self, status: int, body: bytes, headers: dict[str, str] | None = None,
              content_type: str = "application/json; charset=utf-8") -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(body)
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client gave up (a time-out test)

    def _handle(self, method: str) -> None:
        parts = urlsplit(self.path)
        params = dict(parse_qsl(parts.query, keep_blank_values=True))
        body: Any = None
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            raw = self.rfile.read(length)
            try:
                body = json.loads(raw)
            except ValueError:
                body = raw.decode("utf-8", "replace")
        if parts.path in (STATS_PATH, RESET_PATH):  # control, for a server in another process
            if parts.path == RESET_PATH:
                self.wiki.reset()
            stats = {"requests": self.wiki.count(), "max_inflight": self.wiki.max_inflight}
            self._send(200, json.dumps(stats).encode())
            return
        kind = ("api" if parts.path == API_PATH else
                "topics" if parts.path == TOPIC_PATH else "other")
        record = {"kind": kind, "method": method, "params": params, "body": body,
                  "headers": dict(self.headers), "t": time.monotonic()}
        wiki = self.wiki
        fault = wiki._enter(record)
        try:
            if wiki.latency:
                time.sleep(wiki.latency)
            if fault is not None and fault.delay:
                time.sleep(fault.delay)
            if fault is not None and fault.status is not None:
                headers = {"Retry-After": fault.retry_after} if fault.retry_after else {}
                text = json.dumps({"error": {"code": "http", "info": f"HTTP {fault.status}"}})
                self._send(fault.status, text.encode(), headers)
                return
            if fault is not None and fault.malformed:
                self._send(200, b'{"batchcomplete":"","query":{"pages":{"23862":{"pagei')
                return
            if fault is not None and fault.maxlag:
                err = {"error": {"code": "maxlag", "info": "Waiting for 10.64.0.1: 7 seconds "
                                 "lagged.", "host": "10.64.0.1", "lag": 7, "type": "db"}}
                headers = {"MediaWiki-API-Error": "maxlag",
                           "Retry-After": fault.retry_after or "0"}
                self._send(200, json.dumps(err).encode(), headers)
                return
            if kind == "api" and method == "GET":
                self._send(200, json.dumps(wiki.api(params)).encode())
            elif kind == "topics" and method == "POST":
                status, obj = wiki.topics(body)
                self._send(status, json.dumps(obj).encode())
            else:
                self._send(404, b'{"error": "not found"}')
        finally:
            wiki._leave()

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._handle("GET")

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        self._handle("POST")


def unreachable_url(path: str = API_PATH) -> str:
    """A loopback URL on a port nobody listens on (connections are refused)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}{path}"


def main() -> None:
    """Serve until stdin closes; print the endpoints as one JSON line first."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(description="Loopback MediaWiki + Lift Wing server.")
    parser.add_argument("--latency", type=float, default=0.0, help="seconds per request")
    parser.add_argument("--synthetic", type=int, default=0,
                        help="serve only N made-up pages 'Article 00000'...")
    args = parser.parse_args()
    pages = synthetic_pages(args.synthetic) if args.synthetic else None
    with WikiServer(pages=pages, latency=args.latency) as server:
        print(json.dumps({"url": server.url, "topic_url": server.topic_url}), flush=True)
        sys.stdin.read()  # returns when the parent closes our stdin or exits


if __name__ == "__main__":
    main()
