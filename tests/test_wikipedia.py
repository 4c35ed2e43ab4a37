"""Tests of the Wikipedia dataset builder (fedctl/datasets/wikipedia/, fedctl/datasets/cli.py).

Every request goes to a real HTTP server on 127.0.0.1 (tests/wiki_server.py) that answers in
the shape of the recorded MediaWiki and Lift Wing responses in tests/fixtures/wikipedia and
injects faults on demand. Nothing here touches the internet. Retries use 0.01 s back-off.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests
from click.testing import CliRunner

from common.data.reading import DataError, make_task, read_jsonl
from fedctl.datasets.cli import data
from fedctl.datasets.taxonomy import ARTICLETOPIC_LABELS, DEFAULT_TOPIC, check_topic
from fedctl.datasets.wikipedia import (
    ApiUnreachable,
    ResponseCache,
    RetryPolicy,
    WikiClient,
    build_dataset,
    parse_retry_after,
    read_history,
    read_titles,
    write_jsonl,
)
from tests.wiki_server import (
    WikiServer,
    load_fixture,
    synthetic_pages,
    topic_labels,
    unreachable_url,
)

PYTHON = "Python (programming language)"
ADAMS = "Douglas Adams"
MISSING = "NonExistentPage_WikiAPI_Test_12345"  # the recorded missing page


@pytest.fixture
def server() -> Iterator[WikiServer]:
    with WikiServer() as srv:
        yield srv


def client_for(srv: WikiServer, cache: Path | None = None, retries: int = 2,
               timeout: float = 2.0, concurrency: int = 4, **kwargs: Any) -> WikiClient:
    """A client with fast retries (0.01 s base back-off)."""
    policy = RetryPolicy(retries=retries, backoff=0.01, max_backoff=0.05, timeout=timeout)
    return WikiClient(kwargs.pop("api_url", srv.url), kwargs.pop("topic_api_url", srv.topic_url),
                      retry=policy, cache=ResponseCache(cache) if cache else None,
                      concurrency=concurrency, **kwargs)


def request_ids(log: list[dict[str, Any]]) -> list[tuple]:
    """What identifies a request (so two runs can be compared)."""
    return [(r["kind"], r["method"], tuple(sorted(r["params"].items())),
             json.dumps(r["body"], sort_keys=True)) for r in log]


def cli(*args: str) -> Any:
    result = CliRunner().invoke(data, list(args), catch_exceptions=False)
    return result


def assert_one_line_error(result: Any, *needles: str) -> None:
    assert result.exit_code != 0, result.output
    assert "Traceback" not in result.output
    lines = [ln for ln in result.output.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.output
    for needle in needles:
        assert needle in lines[0], lines[0]


# --------------------------------------------------------------------------------------------
# Topic labels
# --------------------------------------------------------------------------------------------


def test_taxonomy_is_the_64_labels_of_the_model_card() -> None:
    assert list(ARTICLETOPIC_LABELS) == topic_labels()
    assert len(set(ARTICLETOPIC_LABELS)) == 64
    assert DEFAULT_TOPIC == "STEM.Technology" and check_topic(" STEM.Technology ") == DEFAULT_TOPIC


@pytest.mark.parametrize("bad, hint", [("stem.technology", "did you mean: STEM.Technology"),
                                       ("STEM.Earth_and_environment", "STEM.Earth and environment"),
                                       ("Technology", "64 articletopic labels"),
                                       ("", "64 articletopic labels")])
def test_check_topic_refuses_other_names(bad: str, hint: str) -> None:
    with pytest.raises(ValueError, match="unknown topic") as err:
        check_topic(bad)
    assert hint in str(err.value) and "\n" not in str(err.value)


# --------------------------------------------------------------------------------------------
# The loopback server speaks like the recordings
# --------------------------------------------------------------------------------------------


def test_server_answers_in_the_recorded_shape(server: WikiServer) -> None:
    def get(**params: Any) -> dict[str, Any]:
        return requests.get(server.url, params={"action": "query", "format": "json", **params},
                            timeout=5).json()

    info = load_fixture("wikipediaapi_query_info_Python.json")["query"]
    got = get(prop="info", titles="Python_(programming_language)")["query"]
    assert got["normalized"] == info["normalized"]
    assert got["pages"]["23862"]["lastrevid"] == info["pages"]["23862"]["lastrevid"]

    missing = load_fixture("wikipediaapi_query_info_missing_page.json")["query"]
    got = get(prop="info", titles=MISSING)["query"]
    assert got["normalized"] == missing["normalized"]
    assert got["pages"]["-1"]["missing"] == missing["pages"]["-1"]["missing"] == ""
    assert got["pages"]["-1"]["title"] == missing["pages"]["-1"]["title"]

    recorded = load_fixture("wikipediaapi_query_random_3.json")["query"]["random"]
    assert get(list="random", rnnamespace=0, rnlimit=3)["query"]["random"] == recorded

    physics = load_fixture("wikipediaapi_query_categorymembers_Physics.json")["query"]
    got = get(list="categorymembers", cmtitle="Category:Physics", cmlimit=500)["query"]
    assert got["categorymembers"] == physics["categorymembers"]


# --------------------------------------------------------------------------------------------
# Extracts: normalization, redirects, missing and disambiguation pages, batching
# --------------------------------------------------------------------------------------------


def test_extracts_follow_normalization_and_redirects(server: WikiServer) -> None:
    asked = ["Python_(programming_language)", "douglas Noël Adams",
             "Douglas Adams (disambiguation)", MISSING]
    with client_for(server) as client:
        pages = client.fetch_extracts(asked)

    py = pages["Python_(programming_language)"]
    recorded = load_fixture("wikipediaapi_query_extracts_explaintext_Python.json")
    full_text = recorded["query"]["pages"]["23862"]["extract"]
    assert (py.title, py.pageid, py.revid) == (PYTHON, 23862, 1345336232)
    assert py.normalized and not py.redirected
    assert py.text.startswith("Python is a high-level") and "== History ==" not in py.text
    assert full_text.startswith(py.text) and len(py.text) < len(full_text) / 10  # lead only

    adams = pages["douglas Noël Adams"]
    assert (adams.title, adams.pageid, adams.revid) == (ADAMS, 8091, 841482403)
    assert adams.normalized and adams.redirected and adams.text.startswith("Douglas Noel Adams")
    assert pages["Douglas Adams (disambiguation)"].disambiguation
    assert pages[MISSING].missing and pages[MISSING].pageid is None

    assert server.count() == 1  # four titles, one request
    (req,) = server.log
    p = req["params"]
    assert p["titles"].split("|") == asked
    assert p["prop"].split("|") == ["extracts", "info", "pageprops"]
    assert (p["exintro"], p["explaintext"], p["redirects"], p["maxlag"]) == ("1", "1", "1", "5")
    assert p["ppprop"] == "disambiguation" and p["format"] == "json"
    assert req["headers"]["User-Agent"].startswith("fedctl/")


def test_build_records_missing_disambiguation_duplicates_and_invalid(server: WikiServer) -> None:
    asked = [ADAMS, "Python_(programming_language)", "Douglas Noel Adams", MISSING,
             "Douglas Adams (disambiguation)", "Bad|title", PYTHON]
    with client_for(server) as client:
        res = build_dataset(asked, client)
    assert [r["title"] for r in res.rows] == [ADAMS, PYTHON]  # input order, each page once
    assert res.missing == {MISSING: "missing", "Bad|title": "invalid title"}
    assert res.disambiguation == ["Douglas Adams (disambiguation)"]
    assert res.duplicates == {"Douglas Noel Adams": ADAMS, PYTHON: "Python_(programming_language)"}
    assert res.failed == {} and res.redirected == 1 and res.normalized == 2
    assert server.count("topics") == 2  # one score request per distinct page
    assert all("Bad|title" not in r["params"].get("titles", "") for r in server.log)


def test_titles_are_batched_20_per_request(server: WikiServer) -> None:
    server.pages.update(synthetic_pages(45))
    titles = list(synthetic_pages(45))
    with client_for(server) as client:
        res = build_dataset(titles, client, concurrency=2)
    sizes = sorted(len(r["params"]["titles"].split("|")) for r in server.log if r["kind"] == "api")
    assert sizes == [5, 20, 20]
    assert [r["title"] for r in res.rows] == titles


def test_batch_continuation_is_followed(server: WikiServer) -> None:
    server.extract_limit = 2  # the server hands out 2 extracts per response
    server.pages.update(synthetic_pages(5))
    titles = list(synthetic_pages(5))
    with client_for(server) as client:
        pages = client.fetch_extracts(titles)
    assert all(p.text.startswith(t) and p.revid for t, p in pages.items())
    conts = [r["params"].get("excontinue") for r in server.log]
    assert conts == [None, "2", "4"]
    # Continuations carry the same titles and only the properties still missing.
    assert {r["params"]["titles"] for r in server.log} == {"|".join(titles)}


# --------------------------------------------------------------------------------------------
# Faults: 429 + Retry-After, 5xx, time-outs, malformed JSON, maxlag, unreachable
# --------------------------------------------------------------------------------------------


def test_429_with_retry_after_is_honoured(server: WikiServer) -> None:
    server.add_fault(kind="api", status=429, retry_after="1")
    with client_for(server) as client:
        t0 = time.monotonic()
        pages = client.fetch_extracts([PYTHON])
        elapsed = time.monotonic() - t0
    assert pages[PYTHON].revid == 1345336232
    assert server.count() == 2 and client.stats["retries"] == 1
    assert elapsed >= 1.0  # waited as told, not the 0.01 s back-off


def test_retry_after_parsing() -> None:
    assert parse_retry_after("3") == 3.0
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # in the past
    assert parse_retry_after("soon") is None and parse_retry_after(None) is None
    policy = RetryPolicy(backoff=0.5, max_backoff=1.0, max_retry_after=2.0)
    assert all(0 <= policy.delay(10) <= 1.0 for _ in range(50))
    assert all(2.0 <= policy.delay(0, retry_after=30) <= 2.5 for _ in range(50))


def test_500_then_success(server: WikiServer) -> None:
    server.add_fault(kind="topics", status=500, times=2)
    with client_for(server) as client:
        scores = client.topic_scores(1345336232)
    assert scores["STEM.Technology"] == 0.93 and len(scores) == 64
    assert server.count("topics") == 3 and client.stats["retries"] == 2


def test_response_slower_than_the_timeout_is_retried(server: WikiServer) -> None:
    server.add_fault(kind="api", delay=3.0)
    with client_for(server, timeout=0.3) as client:
        t0 = time.monotonic()
        pages = client.fetch_extracts([ADAMS])
        elapsed = time.monotonic() - t0
    assert pages[ADAMS].pageid == 8091
    assert server.count() == 2
    # gave up on the slow answer after 0.3 s instead of waiting 3 s (room for a loaded machine)
    assert elapsed < 2.4


def test_malformed_json_is_retried_and_not_cached(server: WikiServer, tmp_path: Path) -> None:
    server.add_fault(kind="api", malformed=True)
    with client_for(server, cache=tmp_path) as client:
        assert client.fetch_extracts([PYTHON])[PYTHON].pageid == 23862
    assert server.count() == 2
    assert len(list(tmp_path.rglob("*.json"))) == 1  # only the good answer
    server.reset()
    with client_for(server, cache=tmp_path) as client:
        assert client.fetch_extracts([PYTHON])[PYTHON].pageid == 23862
    assert server.count() == 0


def test_maxlag_error_is_retried(server: WikiServer) -> None:
    server.add_fault(kind="api", maxlag=True, retry_after="0")
    with client_for(server) as client:
        assert client.fetch_extracts([ADAMS])[ADAMS].revid == 841482403
    assert server.count() == 2 and client.stats["retries"] == 1
    assert all(r["params"]["maxlag"] == "5" for r in server.log)


def test_failures_after_retries_are_recorded_per_title(server: WikiServer) -> None:
    server.pages.update(synthetic_pages(4))
    bad = "Article 00001"
    server.add_fault(kind="api", status=503, times=-1,
                     when=lambda r: bad in r["params"].get("titles", ""))
    server.add_fault(kind="topics", status=404, times=-1,
                     when=lambda r: r["body"]["rev_id"] == server.pages[ADAMS].revid)
    with client_for(server, retries=2) as client:
        res = build_dataset([*synthetic_pages(4), ADAMS], client, batch_size=1)
    assert res.failed == {bad: "HTTP 503 after 3 attempts",
                          ADAMS: res.failed[ADAMS]}
    assert res.failed[ADAMS].startswith("HTTP 404")  # a 4xx is not retried
    assert [r["title"] for r in res.rows] == ["Article 00000", "Article 00002", "Article 00003"]
    summary = res.summary()
    assert summary["failed"] == 2 and summary["fetched"] == 3
    assert sum(summary["label_balance"].values()) == 3
    adams_scores = [r for r in server.log if r["kind"] == "topics"
                    and r["body"]["rev_id"] == server.pages[ADAMS].revid]
    assert len(adams_scores) == 1


def test_unreachable_api_raises_after_its_retries() -> None:
    url = unreachable_url()
    policy = RetryPolicy(retries=2, backoff=0.01, timeout=1.0)
    with WikiClient(url, url, retry=policy) as client:
        with pytest.raises(ApiUnreachable, match="connection refused .3 attempts.") as err:
            build_dataset([PYTHON, ADAMS], client)
        assert client.stats["requests"] == 3  # one batch, its retries, nothing more
    assert "\n" not in str(err.value)


# --------------------------------------------------------------------------------------------
# Topics, labels, concurrency, inputs
# --------------------------------------------------------------------------------------------


def test_topics_and_labels(server: WikiServer, tmp_path: Path) -> None:
    with client_for(server, cache=tmp_path) as client:
        res = build_dataset([PYTHON, ADAMS], client)
        rows = {r["title"]: r for r in res.rows}
        assert set(rows[PYTHON]) == {"title", "pageid", "revid", "text", "topics", "label"}
        assert list(rows[PYTHON]["topics"]) == topic_labels()
        assert rows[PYTHON]["topics"]["STEM.Computing"] == 0.98
        assert (rows[PYTHON]["label"], rows[ADAMS]["label"]) == (1, 0)
        assert res.label_balance == {0: 1, 1: 1}

        lit = build_dataset([PYTHON, ADAMS], client, topic="Culture.Literature")
        assert {r["title"]: r["label"] for r in lit.rows} == {PYTHON: 0, ADAMS: 1}
        strict = build_dataset([PYTHON], client, threshold=0.95)  # 0.93 < 0.95
        assert strict.rows[0]["label"] == 0
        with pytest.raises(ValueError, match="unknown topic"):
            build_dataset([PYTHON], client, topic="Technology")


def test_topic_response_without_scores_is_a_failure(server: WikiServer) -> None:
    from fedctl.datasets.wikipedia import RequestFailed, parse_topic_scores

    with pytest.raises(RequestFailed, match="RevisionNotFound"):
        parse_topic_scores({"enwiki": {"scores": {"5": {"articletopic": {"error": {
            "message": "RevisionNotFound: no such revision", "type": "RevisionNotFound"}}}}}}, 5)
    with pytest.raises(RequestFailed, match="no 'scores'"):
        parse_topic_scores({"something": "else"}, 5)


def test_pool_is_bounded_and_parallel(server: WikiServer) -> None:
    server.latency = 0.1
    server.pages.update(synthetic_pages(24))
    with client_for(server, concurrency=4) as client:
        t0 = time.monotonic()
        res = build_dataset(list(synthetic_pages(24)), client, batch_size=1, concurrency=4)
        elapsed = time.monotonic() - t0
    assert len(res.rows) == 24 and server.count() == 48
    assert 3 <= server.max_inflight <= 4
    assert elapsed < 48 * 0.1 / 1.6  # serially it would take 4.8 s; 4 at once, 1.2 s


def test_random_and_category_titles(server: WikiServer) -> None:
    server.list_limit = 10  # forces cmcontinue / rncontinue paging
    recorded = [r["title"] for r in
                load_fixture("wikipediaapi_query_random_3.json")["query"]["random"]]
    physics = load_fixture("wikipediaapi_query_categorymembers_Physics.json")["query"]
    articles = [m["title"] for m in physics["categorymembers"] if m["ns"] == 0]
    with client_for(server) as client:
        drawn = client.random_titles(12)
        assert drawn[:3] == recorded and len(set(drawn)) == 12
        assert client.category_titles("Physics", depth=0) == articles
        assert client.category_titles("Category:Physics", 1) == [*articles, "Acoustics"]
        assert client.category_titles("Physics", 2)[-2:] == ["Acoustics", "Lens"]
    cm = [r["params"] for r in server.log if r["params"].get("list") == "categorymembers"]
    assert any("cmcontinue" in p for p in cm)
    assert all(p["cmnamespace"] in ("0", "0|14") for p in cm)  # no portals, files, templates


def test_read_titles_and_history(tmp_path: Path) -> None:
    titles = tmp_path / "titles.txt"
    titles.write_text("# my list\nPython (programming language)\n\n"
                      "https://en.wikipedia.org/wiki/Douglas_Adams#Career\n"
                      "Python (programming language)\n  Lens  \n", encoding="utf-8")
    assert read_titles(titles) == [PYTHON, "Douglas_Adams", "Lens"]

    tsv = tmp_path / "history.tsv"
    tsv.write_text("Lens\t2026-01-02T10:00:00Z\nOptics\t2026-01-02T09:00:00Z\n"
                   "Lens\t2026-01-01T08:00:00Z\n")
    assert read_history(tsv) == ["Lens", "Optics"]
    csv_file = tmp_path / "history.csv"
    csv_file.write_text('title,timestamp\n"Hello, World",2026-01-01 10:00\n'
                        "Crosby, Stills, Nash & Young,1700000000\nLens,2026-01-01\n")
    assert read_history(csv_file) == ["Hello, World", "Crosby, Stills, Nash & Young", "Lens"]

    bad = tmp_path / "bad.tsv"
    bad.write_text("Lens\t2026-01-01\nno timestamp here\n")
    with pytest.raises(DataError, match=r"bad.tsv:2: expected 'title<TAB>timestamp'"):
        read_history(bad)


# --------------------------------------------------------------------------------------------
# Cache and resume
# --------------------------------------------------------------------------------------------


def test_interrupted_build_resumes_from_cache(server: WikiServer, tmp_path: Path) -> None:
    server.pages.update(synthetic_pages(30))
    titles = [PYTHON, *synthetic_pages(30)]
    cache = tmp_path / "cache"

    done = 0

    def interrupt_after_10(n: int) -> None:
        nonlocal done
        done += n
        if done >= 10:
            raise KeyboardInterrupt

    with client_for(server, cache=cache, concurrency=2) as client:
        with pytest.raises(KeyboardInterrupt):
            build_dataset(titles, client, batch_size=5, concurrency=2,
                          progress=interrupt_after_10)
    first = request_ids(server.log)
    assert 0 < len(first) < 7 + 31  # stopped before the end

    server.reset()
    with client_for(server, cache=cache) as client:
        res = build_dataset(titles, client, batch_size=5)
    second = request_ids(server.log)
    assert second and not set(first) & set(second)  # nothing fetched twice
    assert len(first) + len(second) == 7 + 31  # 7 extract batches + 31 topic requests
    assert res.stats["cache_hits"] == len(first) and len(res.rows) == 31

    server.reset()
    with client_for(server, cache=cache) as client:
        again = build_dataset(titles, client, batch_size=5)
    assert server.count() == 0  # everything from the cache
    assert again.rows == res.rows


# --------------------------------------------------------------------------------------------
# The CLI
# --------------------------------------------------------------------------------------------


def _wiki_args(srv: WikiServer, tmp_path: Path, *extra: str) -> list[str]:
    return ["wikipedia", "--api-url", srv.url, "--topic-api-url", srv.topic_url,
            "--cache-dir", str(tmp_path / "cache"), "--no-progress", "--retries", "1",
            "--backoff", "0.01", "--timeout", "2", *extra]


def test_cli_builds_a_dataset_the_cluster_can_read(server: WikiServer, tmp_path: Path) -> None:
    history = tmp_path / "history.tsv"
    history.write_text(f"Python_(programming_language)\t2026-03-01T10:00:00Z\n"
                       f"Douglas Noël Adams\t2026-03-01T09:00:00Z\n{MISSING}\t2026-02-01\n"
                       "Douglas Adams (disambiguation)\t2026-01-01\n")
    out = tmp_path / "out" / "wiki.jsonl"
    result = cli(*_wiki_args(server, tmp_path, "--history", str(history), "--random", "2",
                             "-o", str(out), "-j", "3"))
    assert result.exit_code == 0, result.output
    assert "wrote 4 articles" in result.output and "missing 1, disambiguation 1" in result.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["title"] for r in rows][:2] == [PYTHON, ADAMS]
    assert all(set(r) == {"title", "pageid", "revid", "text", "topics", "label"} for r in rows)
    assert all(len(r["topics"]) == 64 and r["label"] in (0, 1) for r in rows)

    dataset = read_jsonl(out)  # directly usable as the cluster's data.path
    y, classes = make_task(dataset.labels, "multiclass")
    assert classes == ["0", "1"] and len(y) == 4
    summary = json.loads((out.parent / "wiki.summary.json").read_text())
    assert summary["missing_titles"] == {MISSING: "missing"} and summary["fetched"] == 4


def test_cli_topic_option_is_validated(server: WikiServer, tmp_path: Path) -> None:
    titles = tmp_path / "t.txt"
    titles.write_text(f"{PYTHON}\n")
    result = cli(*_wiki_args(server, tmp_path, "--titles", str(titles), "--topic", "Tech"))
    assert_one_line_error(result, "unknown topic 'Tech'", "64 articletopic labels")
    assert server.count() == 0
    listed = cli("wikipedia", "--list-topics")
    assert listed.exit_code == 0 and listed.output.splitlines() == list(ARTICLETOPIC_LABELS)


@pytest.mark.parametrize("content, needle", [
    (None, "no such file"),
    ("dir", "is a directory"),
    (b"\xff\xfe\x00bad", "not UTF-8"),
    ("# only a comment\n\n", "no titles"),
])
def test_cli_unreadable_titles_file(tmp_path: Path, content: Any, needle: str) -> None:
    path = tmp_path / "titles.txt"
    if content == "dir":
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    url = unreachable_url()
    result = cli("wikipedia", "--titles", str(path), "--api-url", url, "--topic-api-url", url,
                 "--no-progress", "--cache-dir", str(tmp_path / "c"))
    assert_one_line_error(result, str(path), needle)


def test_cli_unreachable_api(tmp_path: Path) -> None:
    titles = tmp_path / "t.txt"
    titles.write_text(f"{PYTHON}\n")
    url = unreachable_url()
    result = cli("wikipedia", "--titles", str(titles), "--api-url", url, "--topic-api-url", url,
                 "--no-progress", "--retries", "2", "--backoff", "0.01",
                 "--cache-dir", str(tmp_path / "c"), "-o", str(tmp_path / "o.jsonl"))
    assert_one_line_error(result, "cannot reach", url, "connection refused (3 attempts)")
    assert not (tmp_path / "o.jsonl").exists()


def test_cli_nothing_to_fetch_and_all_missing(server: WikiServer, tmp_path: Path) -> None:
    assert_one_line_error(cli("wikipedia", "--no-progress"), "nothing to fetch")
    titles = tmp_path / "t.txt"
    titles.write_text(f"{MISSING}\n")
    out = tmp_path / "o.jsonl"
    result = cli(*_wiki_args(server, tmp_path, "--titles", str(titles), "-o", str(out)))
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert result.output.strip().splitlines()[-1].startswith("Error: no article to write")
    assert not out.exists()


def test_cli_category_and_interrupt(server: WikiServer, tmp_path: Path,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "phys.jsonl"
    result = cli(*_wiki_args(server, tmp_path, "--category", "Subfields of physics",
                             "--depth", "1", "-o", str(out)))
    assert result.exit_code == 0, result.output
    assert [json.loads(line)["title"] for line in out.read_text().splitlines()] == [
        "Acoustics", "Physics", "Lens"]  # Lens is in the subcategory Optics
    assert_one_line_error(cli(*_wiki_args(server, tmp_path, "--category", "Nothing here")),
                          "no articles in category 'Nothing here'")
    assert_one_line_error(cli(*_wiki_args(server, tmp_path, "--depth", "2", "--random", "1")),
                          "--depth needs --category")

    def interrupted(*args: Any, **kwargs: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr("fedctl.datasets.cli.build_dataset", interrupted)
    out.unlink()
    result = cli(*_wiki_args(server, tmp_path, "--random", "2", "-o", str(out)))
    assert_one_line_error(result, "interrupted", "resume")
    assert not out.exists()


def test_cli_output_is_atomic_when_the_run_fails_midway(server: WikiServer,
                                                       tmp_path: Path) -> None:
    titles = tmp_path / "t.txt"
    titles.write_text(f"{PYTHON}\n{ADAMS}\n")
    out = tmp_path / "wiki.jsonl"
    out.write_text('{"old": true}\n')
    # Extracts arrive, then the topic API turns out to be unreachable: the run aborts.
    result = cli("wikipedia", "--titles", str(titles), "--api-url", server.url,
                 "--topic-api-url", unreachable_url(), "--no-progress", "--retries", "1",
                 "--backoff", "0.01", "--cache-dir", str(tmp_path / "cache"), "-o", str(out))
    assert_one_line_error(result, "cannot reach")
    assert server.count("api") == 1
    assert out.read_text() == '{"old": true}\n'  # untouched: no partial file
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "t.txt", "wiki.jsonl"]


def test_write_jsonl_leaves_no_partial_file(tmp_path: Path) -> None:
    out = tmp_path / "x.jsonl"

    def rows() -> Iterator[dict[str, Any]]:
        yield {"text": "a", "label": 1}
        raise RuntimeError("failed midway")

    with pytest.raises(RuntimeError):
        write_jsonl(out, rows())
    assert list(tmp_path.iterdir()) == []
    write_jsonl(out, [{"text": "é", "label": 0}])
    assert out.read_text(encoding="utf-8") == '{"text": "é", "label": 0}\n'


def test_cli_help() -> None:
    for args in ([], ["wikipedia"], ["embed"]):
        result = cli(*args, "--help")
        assert result.exit_code == 0 and "Usage:" in result.output
    assert "--concurrency" in cli("wikipedia", "--help").output


def test_cli_embed(tmp_path: Path) -> None:
    src = tmp_path / "wiki.jsonl"
    rows = [{"title": f"T{i}", "text": f"Sentence number {i} about engines.", "label": i % 2}
            for i in range(5)]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    prefix = tmp_path / "feat" / "wiki"
    result = cli("embed", str(src), "-o", str(prefix), "--cache-dir", str(tmp_path / "emb"),
                 "--device", "cpu", "--no-progress")
    assert result.exit_code == 0, result.output
    X = np.load(str(prefix) + ".npy")
    assert X.shape == (5, 384) and X.dtype == np.float32 and np.isfinite(X).all()
    index = [json.loads(line) for line in Path(str(prefix) + ".index.jsonl").read_text()
             .splitlines()]
    assert [(r["row"], r["title"], r["label"]) for r in index] == [
        (i, f"T{i}", i % 2) for i in range(5)]
    assert all(len(r["text_sha256"]) == 64 for r in index)

    # The cluster embeds data.path the same way: with the same cache folder it finds these.
    from common.data.embedding import embed_texts

    again = embed_texts([r["text"] for r in rows], cache_dir=tmp_path / "emb", progress=False)
    assert np.array_equal(again, X) and len(list((tmp_path / "emb").glob("*.npy"))) == 1

    assert_one_line_error(cli("embed", str(src), "-o", str(prefix), "--model",
                              str(tmp_path / "nope"), "--no-progress"),
                          "not a sentence-transformers model folder")
    assert_one_line_error(cli("embed", str(tmp_path / "missing.jsonl"), "-o", str(prefix)),
                          "no such file")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "x", "label": "a"}\n{"text": "y"}\n')
    assert_one_line_error(cli("embed", str(bad), "-o", str(prefix)),
                          "bad.jsonl:2: missing field 'label' (line 1 has one)")


def test_cli_embed_reads_what_the_cluster_reads(tmp_path: Path) -> None:
    """A CSV table and a JSONL file with a byte-order mark: `fedctl check` and the cluster
    read both, and embed failed on them with 'embedding failed: Expecting value' and
    'Unexpected UTF-8 BOM' (its index re-read the file as plain JSONL)."""
    table = tmp_path / "t.csv"
    table.write_text('text,label\n"hello world",a\n"second doc",b\n')
    marked = tmp_path / "bom.jsonl"
    marked.write_bytes(b'\xef\xbb\xbf{"text": "bom first", "label": "a", "title": "T"}\n'
                       b'{"text": "second", "label": "b"}\n')
    for src, first in ((table, {"row": 0, "label": "a"}),
                       (marked, {"row": 0, "title": "T", "label": "a"})):
        prefix = tmp_path / src.stem
        result = cli("embed", str(src), "-o", str(prefix), "--cache-dir", str(tmp_path / "emb"),
                     "--device", "cpu", "--no-progress")
        assert result.exit_code == 0, result.output
        assert np.load(str(prefix) + ".npy").shape == (2, 384)
        index = [json.loads(line) for line in Path(str(prefix) + ".index.jsonl").read_text()
                 .splitlines()]
        assert len(index) == 2 and {k: index[0][k] for k in first} == first
