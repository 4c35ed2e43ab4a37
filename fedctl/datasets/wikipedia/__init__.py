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

Modules
-------
errors
    :class:`WikiError` and its kinds.
retry
    :class:`RetryPolicy` and ``Retry-After`` parsing.
cache
    :class:`ResponseCache`, the on-disk response cache.
pages
    :class:`Page` and the parsing of the APIs' answers.
client
    :class:`WikiClient`, the HTTP client, and the endpoints' defaults and limits.
titles
    Reading title files and viewing-history exports.
build
    :func:`build_dataset`, :class:`BuildResult` and :func:`write_jsonl`.

The names below are re-exported here, so ``from fedctl.datasets.wikipedia import X`` works for
all of them.

Typical use::

    client = WikiClient(cache=ResponseCache(default_cache_dir()), concurrency=4)
    result = build_dataset(read_titles("titles.txt"), client, topic="STEM.Technology")
    write_jsonl("wiki.jsonl", result.rows)
"""

from fedctl.datasets.taxonomy import DEFAULT_TOPIC
from fedctl.datasets.wikipedia.build import BuildResult, build_dataset, write_jsonl
from fedctl.datasets.wikipedia.cache import ResponseCache, default_cache_dir
from fedctl.datasets.wikipedia.client import (
    DEFAULT_API_URL,
    DEFAULT_TOPIC_API_URL,
    MAX_INTRO_EXTRACTS,
    MAX_LIST_LIMIT,
    MAX_TITLES_PER_QUERY,
    WikiClient,
    default_user_agent,
)
from fedctl.datasets.wikipedia.errors import ApiUnreachable, RequestFailed, WikiError
from fedctl.datasets.wikipedia.pages import Page, parse_topic_scores
from fedctl.datasets.wikipedia.retry import RetryPolicy, parse_retry_after
from fedctl.datasets.wikipedia.titles import clean_title, dedupe, read_history, read_titles

__all__ = [
    "DEFAULT_API_URL",
    "DEFAULT_TOPIC_API_URL",
    "DEFAULT_TOPIC",
    "MAX_TITLES_PER_QUERY",
    "MAX_INTRO_EXTRACTS",
    "MAX_LIST_LIMIT",
    "WikiError",
    "ApiUnreachable",
    "RequestFailed",
    "RetryPolicy",
    "parse_retry_after",
    "ResponseCache",
    "Page",
    "parse_topic_scores",
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
