"""Building the labelled dataset: fetch every title's lead, score its topics, label it.

:func:`build_dataset` runs the extracts batches and the per-article topic requests of a
:class:`~fedctl.datasets.wikipedia.client.WikiClient` on one bounded thread pool and sorts
every input title into a row or a reason why there is none (:class:`BuildResult`);
:func:`write_jsonl` writes the rows.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from common.atomic import atomic_write_bytes
from fedctl.datasets.taxonomy import DEFAULT_TOPIC, check_topic
from fedctl.datasets.wikipedia.client import MAX_INTRO_EXTRACTS, MAX_TITLES_PER_QUERY, WikiClient
from fedctl.datasets.wikipedia.errors import ApiUnreachable, WikiError
from fedctl.datasets.wikipedia.pages import Page
from fedctl.datasets.wikipedia.titles import dedupe, is_plausible_title

__all__ = ["BuildResult", "build_dataset", "write_jsonl"]


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


def _check_arguments(topic: str, threshold: float, batch_size: int, concurrency: int) -> str:
    """``topic`` in its canonical spelling; ValueError if any argument is out of range."""
    topic = check_topic(topic)
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"threshold must be between 0 and 1, got {threshold}")
    if not 1 <= batch_size <= MAX_TITLES_PER_QUERY:
        raise ValueError(f"batch size must be between 1 and {MAX_TITLES_PER_QUERY}, "
                         f"got {batch_size}")
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    return topic


class _Build:
    """The state of one :func:`build_dataset` run, and what it does as each request settles.

    Everything is touched from the calling thread only: the pool's threads just run the
    client's requests, and their results are handled here as they complete.
    """

    def __init__(self, titles: list[str], client: WikiClient, topic: str, threshold: float,
                 progress: Callable[[int], None] | None) -> None:
        self.client = client
        self.topic = topic
        self.threshold = threshold
        self.result = BuildResult(requested=len(titles), topic=topic, threshold=threshold)
        self.order = {t: i for i, t in enumerate(titles)}
        self.tick = progress or (lambda n: None)
        # All keyed by page id, since several input titles may reach one page.
        self.by_pageid: dict[int, str] = {}      # the first input title (in input order)
        self.waiting: dict[int, list[str]] = {}  # input titles waiting for its topic scores
        self.scored: set[int] = set()            # pages whose scores arrived
        self.page_failed: dict[int, str] = {}    # pages whose scores could not be had, and why
        self.rows: dict[int, dict[str, Any]] = {}
        self.pages: dict[int, Page] = {}
        # Each request in flight -> what to do with its result, and with its WikiError message.
        self.pending: dict[Future, tuple[Callable[[Any], None], Callable[[str], None]]] = {}
        self.pool: ThreadPoolExecutor | None = None

    def drop_implausible(self, titles: list[str]) -> list[str]:
        """The titles worth sending; the others are recorded as invalid (and ticked)."""
        valid: list[str] = []
        for title in titles:
            if is_plausible_title(title):
                valid.append(title)
            else:
                self.result.missing[title] = "invalid title"
                self.tick(1)
        return valid

    def run(self, titles: list[str], batch_size: int, concurrency: int) -> None:
        """Fetch ``titles`` in batches and score their pages until nothing is in flight.

        Raises
        ------
        ApiUnreachable
            If an endpoint cannot be reached at all; the pool is stopped first.
        """
        self.client.stop.clear()
        self.pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="wiki")
        try:
            for batch in _batches(titles, batch_size):
                self._submit(self.on_extracts, partial(self.on_batch_failed, batch),
                             self.client.fetch_extracts, batch)
            while self.pending:
                done, _ = wait(self.pending, return_when=FIRST_COMPLETED)
                for fut in done:
                    self._settle(fut)
        except BaseException:
            self.client.stop.set()  # waiting retries give up, queued work is dropped
            raise
        finally:
            self.pool.shutdown(wait=True, cancel_futures=True)

    def _submit(self, on_result: Callable[[Any], None], on_error: Callable[[str], None],
                fn: Callable[..., Any], *args: Any) -> None:
        assert self.pool is not None
        self.pending[self.pool.submit(fn, *args)] = (on_result, on_error)

    def _settle(self, fut: Future) -> None:
        on_result, on_error = self.pending.pop(fut)
        try:
            value = fut.result()
        except ApiUnreachable:
            raise
        except WikiError as exc:
            on_error(str(exc))
            return
        on_result(value)

    # ---- extracts -------------------------------------------------------------------------

    def on_batch_failed(self, batch: list[str], reason: str) -> None:
        """An extracts request failed for good: all its titles fail with ``reason``."""
        for title in batch:
            self.result.failed[title] = reason
        self.tick(len(batch))

    def on_extracts(self, pages: dict[str, Page]) -> None:
        """Sort each title of an extracts batch; ask for the scores of each page new so far."""
        for requested, page in pages.items():
            self.result.normalized += page.normalized
            self.result.redirected += page.redirected
            if self._record_unusable(requested, page):
                self.tick(1)
            elif page.pageid in self.by_pageid:
                self._on_duplicate(requested, page.pageid)
            else:
                self._request_topics(requested, page)

    def _record_unusable(self, requested: str, page: Page) -> bool:
        """Record why ``page`` gives no row, if it gives none; whether it was recorded."""
        result = self.result
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
        else:
            return False
        return True

    def _on_duplicate(self, requested: str, pid: int) -> None:
        """``requested`` reached page ``pid``, which an earlier batch already reached."""
        first = self.by_pageid[pid]
        if self.order[requested] < self.order[first]:  # rows follow input order
            self.by_pageid[pid] = requested
            self.result.duplicates[first] = requested
        else:
            self.result.duplicates[requested] = first
        if pid in self.page_failed:
            self.result.failed[requested] = self.page_failed[pid]
        elif pid not in self.scored:
            self.waiting[pid].append(requested)
            return  # ticked when the page is scored
        self.tick(1)

    def _request_topics(self, requested: str, page: Page) -> None:
        """Queue the topic request of a page no title reached before."""
        pid = page.pageid
        assert pid is not None  # _record_unusable took pages without ids
        self.by_pageid[pid] = requested
        self.pages[pid] = page
        self.waiting[pid] = [requested]
        self._submit(partial(self.on_topics, pid), partial(self.on_page_failed, pid),
                     self.client.topic_scores, page.revid)

    # ---- topic scores ---------------------------------------------------------------------

    def on_page_failed(self, pid: int, reason: str) -> None:
        """Page ``pid`` cannot be scored: its titles, and any reaching it later, fail."""
        self.page_failed[pid] = reason
        names = self.waiting.pop(pid, [])
        for title in names:
            self.result.failed[title] = reason
        self.tick(len(names))

    def on_topics(self, pid: int, scores: dict[str, float]) -> None:
        """Page ``pid``'s topic scores arrived: make its row."""
        prob = scores.get(self.topic)
        if prob is None:
            self.on_page_failed(pid, f"topic API: no score for {self.topic}")
            return
        page = self.pages[pid]
        self.rows[pid] = {
            "title": page.title, "pageid": page.pageid, "revid": page.revid,
            "text": page.text, "topics": scores, "label": int(prob >= self.threshold),
        }
        self.scored.add(pid)
        self.tick(len(self.waiting.pop(pid, [])))

    # ---- the end ----------------------------------------------------------------------------

    def finish(self, started: float) -> BuildResult:
        """The result, its rows and title lists in input order."""
        result, order = self.result, self.order
        result.rows = [self.rows[pid] for pid in sorted(
            self.rows, key=lambda pid: order[self.by_pageid[pid]])]
        result.disambiguation.sort(key=order.__getitem__)
        result.empty.sort(key=order.__getitem__)
        result.missing = dict(sorted(result.missing.items(), key=lambda kv: order[kv[0]]))
        result.failed = dict(sorted(result.failed.items(), key=lambda kv: order[kv[0]]))
        result.elapsed = time.monotonic() - started
        result.stats = dict(self.client.stats)
        return result


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
    topic = _check_arguments(topic, threshold, batch_size, concurrency)
    started = time.monotonic()
    titles = dedupe(titles)
    build = _Build(titles, client, topic, threshold, progress)
    build.run(build.drop_implausible(titles), batch_size, concurrency)
    return build.finish(started)


def write_jsonl(path: str | Path, rows: Iterable[dict[str, Any]]) -> None:
    """Write ``rows`` as JSON Lines (UTF-8, one object a line) atomically.

    The file appears complete or not at all; an existing file is replaced only on success.
    """
    data = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    atomic_write_bytes(path, data.encode("utf-8"))
