"""`fedctl data`: build datasets for the cluster.

    fedctl data wikipedia --titles titles.txt -o wiki.jsonl      # fetch, score, label
    fedctl data wikipedia --history history.tsv --random 500 --category Software --depth 1
    fedctl data embed wiki.jsonl -o wiki                          # wiki.npy + wiki.index.jsonl
    fedctl data shard --config cluster.yaml --out shards          # shards/w1.jsonl, ...

Registered on the main CLI with ``main.add_command(data)``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
from pathlib import Path
from typing import Any

import click

from common.data.reading import TABLE_DELIMITERS, DataError, TextDataset
from fedctl.datasets.taxonomy import ARTICLETOPIC_LABELS, DEFAULT_TOPIC, check_topic
from fedctl.datasets.wikipedia import (
    DEFAULT_API_URL,
    DEFAULT_TOPIC_API_URL,
    MAX_INTRO_EXTRACTS,
    MAX_TITLES_PER_QUERY,
    BuildResult,
    ResponseCache,
    RetryPolicy,
    WikiClient,
    WikiError,
    build_dataset,
    dedupe,
    default_cache_dir,
    default_user_agent,
    read_history,
    read_titles,
    write_jsonl,
)

__all__ = ["data"]

LOG_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"
_SHOW = 10  # failed / missing titles listed in the closing summary


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper()), format=LOG_FORMAT,
                        stream=sys.stderr)


def _fail(exc: BaseException | str) -> click.ClickException:
    """A ClickException carrying the first line of ``exc`` (printed as one ``Error:`` line)."""
    text = str(exc).strip()
    return click.ClickException(text.splitlines()[0] if text else type(exc).__name__)


_log_level = click.option("--log-level", default="warning", show_default=True,
                          type=click.Choice(["debug", "info", "warning", "error"]))
_progress = click.option("--progress/--no-progress", default=True, show_default=True,
                         help="Show a progress bar (on stderr).")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def data() -> None:
    """Build datasets: labelled Wikipedia articles, sentence-embedding features, and the
    workers' shards of a dataset."""


# --------------------------------------------------------------------------------------------
# fedctl data wikipedia
# --------------------------------------------------------------------------------------------


def _list_topics(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if value and not ctx.resilient_parsing:
        click.echo("\n".join(ARTICLETOPIC_LABELS))
        ctx.exit(0)


def _summary_path(output: Path) -> Path:
    return output.with_name(output.stem + ".summary.json")


def _print_summary(result: BuildResult, output: Path | None) -> None:
    s = result.summary()
    bal = result.label_balance
    if output is not None:
        click.echo(f"wrote {s['fetched']} articles to {output}: label 1 ({s['topic']} >= "
                   f"{s['threshold']:g}) {bal[1]}, label 0 {bal[0]}")
    click.echo(f"titles {s['requested']}: fetched {s['fetched']}, missing {s['missing']}, "
               f"disambiguation {s['disambiguation']}, empty {s['empty']}, "
               f"duplicates {s['duplicates']}, failed {s['failed']} "
               f"(normalized {s['normalized']}, redirected {s['redirected']})")
    for title, reason in list(result.failed.items())[:_SHOW]:
        click.echo(f"  failed: {title}: {reason}")
    if len(result.failed) > _SHOW:
        click.echo(f"  ... and {len(result.failed) - _SHOW} more failed")
    for title, reason in list(result.missing.items())[:_SHOW]:
        click.echo(f"  missing: {title} ({reason})")
    if len(result.missing) > _SHOW:
        click.echo(f"  ... and {len(result.missing) - _SHOW} more missing")
    req = s["requests"]
    click.echo(f"requests: {req.get('requests', 0)} sent ({req.get('retries', 0)} retries), "
               f"{req.get('cache_hits', 0)} from cache; {s['elapsed_s']:.1f} s")
    if result.failed:
        click.echo("rerun the same command to retry the failed titles; answers already "
                   "received come from the cache")


def _check_wikipedia_options(topic: str, titles_file: str | None, history_file: str | None,
                             n_random: int | None, category: str | None, depth: int,
                             output: str) -> tuple[str, Path]:
    """The canonical topic and the output path, once the options make sense together.

    Checked before anything is read or fetched, so that a typo costs no requests.
    """
    try:
        topic = check_topic(topic)
    except ValueError as exc:
        raise _fail(exc) from None
    if not (titles_file or history_file or n_random or category):
        raise _fail("nothing to fetch: give --titles, --history, --random and/or --category")
    if depth and not category:
        raise _fail("--depth needs --category")
    out = Path(output)
    if out.exists() and out.is_dir():
        raise _fail(f"{out}: is a directory")
    return topic, out


def _read_title_files(titles_file: str | None, history_file: str | None) -> list[str]:
    """The titles of --titles, then those of --history (duplicates are dropped later)."""
    titles: list[str] = []
    try:
        if titles_file:
            titles += read_titles(titles_file)
        if history_file:
            titles += read_history(history_file)
    except DataError as exc:
        raise _fail(exc) from None
    return titles


def _user_agent(user_agent: str | None, contact: str | None, api_url: str,
                topic_api_url: str) -> str:
    """--user-agent, or ours with --contact; a note on stderr when Wikimedia gets no contact."""
    if user_agent is not None:
        return user_agent
    wikimedia = any(host in url for url in (api_url, topic_api_url)
                    for host in ("wikipedia.org", "wikimedia.org"))
    if contact is None and wikimedia:
        click.echo("note: Wikimedia asks API clients for contact details in the "
                   "User-Agent; pass --contact EMAIL_OR_URL", err=True)
    return default_user_agent(contact)


def _add_listed_titles(client: WikiClient, titles: list[str], n_random: int | None,
                       category: str | None, depth: int) -> list[str]:
    """``titles`` followed by --random's and --category's, without duplicates."""
    if n_random:
        titles = titles + client.random_titles(n_random)
    if category:
        found = client.category_titles(category, depth)
        if not found:
            raise _fail(f"no articles in category '{category}' (depth {depth})")
        titles = titles + found
    return dedupe(titles)


def _build_with_progress(titles: list[str], client: WikiClient, progress: bool,
                         **options: Any) -> BuildResult:
    """:func:`build_dataset` of ``titles`` with a progress bar on stderr (unless disabled)."""
    from tqdm import tqdm

    with tqdm(total=len(titles), unit="article", desc="wikipedia", disable=not progress,
              file=sys.stderr, dynamic_ncols=True) as bar:
        return build_dataset(titles, client, progress=bar.update, **options)


def _write_dataset(out: Path, result: BuildResult) -> None:
    """Write the rows to ``out`` and the summary beside it, then print the summary.

    Raises a ClickException, writing nothing, when no title gave a row.
    """
    if not result.rows:
        _print_summary(result, None)
        raise _fail(f"no article to write: none of the {result.requested} titles gave a page "
                    f"with text and topic scores")
    try:
        write_jsonl(out, result.rows)
        summary = json.dumps(result.summary(), ensure_ascii=False, indent=1) + "\n"
        from common.atomic import atomic_write_bytes

        atomic_write_bytes(_summary_path(out), summary.encode("utf-8"))
    except OSError as exc:
        raise _fail(f"{out}: cannot write ({exc.strerror or exc})") from None
    _print_summary(result, out)


@data.command()
@click.option("--titles", "titles_file", metavar="FILE", default=None,
              help="Text file, one title (or article URL) per line; '#' lines skipped.")
@click.option("--history", "history_file", metavar="FILE", default=None,
              help="Viewing history: 'title<TAB>timestamp' or CSV 'title,timestamp' per line "
                   "(optional header line).")
@click.option("--random", "n_random", type=click.IntRange(min=1), default=None, metavar="N",
              help="Add N random articles (the draw is cached like every response, so a "
                   "rerun resumes the same sample; use another --cache-dir for a new one).")
@click.option("--category", default=None, metavar="NAME",
              help="Add the articles of a category ('Category:' prefix optional).")
@click.option("--depth", type=click.IntRange(min=0), default=0, show_default=True,
              help="With --category: also take subcategories this many levels down.")
@click.option("--output", "-o", type=click.Path(dir_okay=False), default="wikipedia.jsonl",
              show_default=True,
              help="JSONL output {title, pageid, revid, text, topics, label}, written "
                   "atomically; a summary goes to OUTPUT_STEM.summary.json.")
@click.option("--topic", default=DEFAULT_TOPIC, show_default=True,
              help="Articletopic label that makes label 1 (see --list-topics).")
@click.option("--threshold", type=click.FloatRange(0.0, 1.0), default=0.5, show_default=True,
              help="Label is 1 when the topic's probability is at least this.")
@click.option("--concurrency", "-j", type=click.IntRange(min=1), default=4, show_default=True,
              help="Requests in flight at most.")
@click.option("--batch-size", type=click.IntRange(1, MAX_TITLES_PER_QUERY),
              default=MAX_INTRO_EXTRACTS, show_default=True,
              help="Titles per extracts request (the API gives 20 intros a request; more "
                   "needs continuation requests).")
@click.option("--api-url", default=DEFAULT_API_URL, show_default=True,
              help="MediaWiki Action API endpoint (a mirror, or another language's wiki).")
@click.option("--topic-api-url", default=DEFAULT_TOPIC_API_URL, show_default=True,
              help="Lift Wing articletopic endpoint (POST {\"rev_id\": N}).")
@click.option("--cache-dir", type=click.Path(file_okay=False), default=None,
              help="Response cache [default: ~/.cache/fedctl/wikipedia].")
@click.option("--no-cache", is_flag=True, help="Neither read nor write the response cache.")
@click.option("--retries", type=click.IntRange(min=0), default=5, show_default=True,
              help="Retries of a failed request (429, 5xx, time-out, bad JSON, maxlag).")
@click.option("--backoff", type=click.FloatRange(min=0.0), default=1.0, show_default=True,
              help="Base back-off in seconds (doubled each retry, with jitter).")
@click.option("--timeout", type=click.FloatRange(min=0.001), default=30.0, show_default=True,
              help="Seconds to wait for a response.")
@click.option("--maxlag", type=click.IntRange(min=0), default=5, show_default=True,
              help="MediaWiki maxlag: back off while replication lags more than this.")
@click.option("--contact", default=None, metavar="EMAIL_OR_URL",
              help="Put into the User-Agent, as Wikimedia's policy asks of clients.")
@click.option("--user-agent", default=None, help="Replace the whole User-Agent.")
@click.option("--list-topics", is_flag=True, expose_value=False, is_eager=True,
              callback=_list_topics, help="Print the 64 articletopic labels and exit.")
@_progress
@_log_level
def wikipedia(titles_file: str | None, history_file: str | None, n_random: int | None,
              category: str | None, depth: int, output: str, topic: str, threshold: float,
              concurrency: int, batch_size: int, api_url: str, topic_api_url: str,
              cache_dir: str | None, no_cache: bool, retries: int, backoff: float,
              timeout: float, maxlag: int, contact: str | None, user_agent: str | None,
              progress: bool, log_level: str) -> None:
    """Fetch Wikipedia articles' lead sections and label them by topic.

    Titles come from --titles, --history, --random and/or --category (in that order,
    duplicates dropped). Each article's lead is fetched as plain text from the MediaWiki API,
    its 64 topic probabilities from Lift Wing's enwiki-articletopic model; label is 1 when
    --topic scores at least --threshold. Missing and disambiguation pages are reported and
    left out. Every successful response is cached, so rerunning an interrupted build
    fetches only what is left.
    """
    _setup_logging(log_level)
    topic, out = _check_wikipedia_options(topic, titles_file, history_file, n_random, category,
                                          depth, output)
    titles = _read_title_files(titles_file, history_file)
    agent = _user_agent(user_agent, contact, api_url, topic_api_url)
    cache = None if no_cache else ResponseCache(cache_dir or default_cache_dir())
    policy = RetryPolicy(retries=retries, backoff=backoff, timeout=timeout)
    client = WikiClient(api_url, topic_api_url, concurrency=concurrency, retry=policy,
                        cache=cache, user_agent=agent, maxlag=maxlag)
    try:
        titles = _add_listed_titles(client, titles, n_random, category, depth)
        result = _build_with_progress(titles, client, progress, topic=topic,
                                      threshold=threshold, batch_size=batch_size,
                                      concurrency=concurrency)
    except KeyboardInterrupt:
        raise _fail("interrupted; nothing written. Rerun the same command to resume: "
                    "the answers received so far are cached") from None
    except (WikiError, ValueError) as exc:
        raise _fail(exc) from None
    finally:
        client.close()
    _write_dataset(out, result)


# --------------------------------------------------------------------------------------------
# fedctl data embed
# --------------------------------------------------------------------------------------------


def _index_rows(dataset: TextDataset) -> list[dict[str, Any]]:
    """``{row, title?, text_sha256, label?}`` for each row of ``dataset`` as read: a JSONL
    line's ``title`` and ``label`` as the line has them, a table's label as read (labels are
    optional: an unlabelled file embeds as well)."""
    path = dataset.path
    if path is not None and path.suffix.lower() not in TABLE_DELIMITERS:
        # (read_jsonl has validated every line; utf-8-sig: a byte-order mark is no text)
        with path.open(encoding="utf-8-sig") as fh:
            lines = [json.loads(line) for line in fh if line.strip()]
    else:
        lines = [{"label": label} if dataset.labelled else {} for label in dataset.labels]
    rows = []
    for i, (text, line) in enumerate(zip(dataset.texts, lines, strict=True)):
        entry: dict[str, Any] = {"row": i}
        if isinstance(line.get("title"), str):
            entry["title"] = line["title"]
        entry["text_sha256"] = hashlib.sha256(text.encode("utf-8")).hexdigest()
        if "label" in line:
            entry["label"] = line["label"]
        rows.append(entry)
    return rows


@data.command()
@click.argument("input_path", metavar="INPUT.jsonl", type=click.Path(dir_okay=False))
@click.option("--output", "-o", required=True, metavar="PREFIX",
              help="Writes PREFIX.npy (float32, one row per line of INPUT) and "
                   "PREFIX.index.jsonl (row, title or text hash, label).")
@click.option("--model", default=None, metavar="PATH",
              help="A local sentence-transformers model folder "
                   "[default: the bundled all-MiniLM-L6-v2].")
@click.option("--batch-size", type=click.IntRange(min=1), default=None,
              help="[default: the backend's: 64 torch, 32 openvino, 16 onnx-int8]")
@click.option("--device", default="auto", show_default=True,
              help="auto (CUDA when present), cpu, cuda, cuda:N or mps.")
@click.option("--backend", default=None, metavar="NAME",
              help="auto (the fastest available: openvino on a CPU-only machine, torch with a "
                   "GPU), torch, openvino or onnx-int8 [default: $FEDCTL_EMBED_BACKEND or auto].")
@click.option("--cache-dir", type=click.Path(file_okay=False), default=None,
              help="Embedding cache [default: $FEDCTL_CACHE_DIR or ~/.cache/fedctl/embeddings, "
                   "the one the cluster uses].")
@_progress
@_log_level
def embed(input_path: str, output: str, model: str | None, batch_size: int | None, device: str,
          backend: str | None, cache_dir: str | None, progress: bool, log_level: str) -> None:
    """Sentence-transformer features of a JSONL file of {text, label} lines.

    Any other fields are ignored (a 'title' is copied into the index). With the default
    cache folder this also fills the cache a cluster reading the same file would compute.
    """
    _setup_logging(log_level)
    from common.atomic import atomic_save_npy, atomic_write_bytes
    from common.data.embedding import embed_texts_with_backend, resolve_device
    from common.data.embedding_backends import check_backend_name
    from common.data.reading import read_jsonl

    prefix = output[:-4] if output.endswith(".npy") else output
    if model is not None and not (Path(model).is_dir()
                                  and (Path(model) / "config.json").is_file()):
        raise _fail(f"{model}: not a sentence-transformers model folder (no config.json)")
    try:
        if backend is not None:
            check_backend_name(backend)  # before reading anything
        dataset = read_jsonl(input_path)
        index = _index_rows(dataset)
        dev = resolve_device(device)
        features, used = embed_texts_with_backend(
            dataset.texts, model_path=model, cache_dir=cache_dir, batch_size=batch_size,
            device=dev, progress=progress, backend=backend)
    except DataError as exc:
        raise _fail(exc) from None
    except (OSError, ValueError, RuntimeError) as exc:  # model files, torch
        raise _fail(f"embedding failed: {exc}") from None
    try:
        atomic_save_npy(prefix + ".npy", features)
        lines = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in index)
        atomic_write_bytes(prefix + ".index.jsonl", lines.encode("utf-8"))
    except OSError as exc:
        raise _fail(f"{prefix}: cannot write ({exc.strerror or exc})") from None
    click.echo(f"wrote {features.shape[0]} x {features.shape[1]} float32 features to "
               f"{prefix}.npy and the index to {prefix}.index.jsonl (device {dev}, backend {used})")


# --------------------------------------------------------------------------------------------
# fedctl data shard
# --------------------------------------------------------------------------------------------


@data.command()
@click.option("--config", "-c", default="cluster.yaml", show_default=True,
              type=click.Path(dir_okay=False),
              help="Cluster description: its data section (partition, alpha, task, limit, "
                   "test_fraction), seed and workers.")
@click.option("--data", "data_path", type=click.Path(dir_okay=False), default=None,
              metavar="PATH", help="The dataset to cut [default: data.path of the config].")
@click.option("--out", "-o", "out_dir", required=True, type=click.Path(file_okay=False),
              metavar="DIR", help="Folder of the shards, one DIR/<worker>.jsonl each.")
@click.option("--workers", "-n", "n_workers", type=int, default=None,
              help="Cut for w1..wN, as `fedctl run --workers N` runs them (default: the "
                   "config's workers).")
@click.option("--among-named", is_flag=True,
              help="Cut the dataset among the named workers only, not all the config's (for "
                   "a cluster whose other workers bring files of their own).")
@click.option("--json", "as_json", is_flag=True,
              help="Print {sizes, written, unchanged} as one JSON object.")
@click.option("--force", is_flag=True,
              help="Replace files in DIR that an earlier `fedctl data shard` did not write "
                   "(by default they are left alone and the command stops).")
@click.argument("workers", nargs=-1, metavar="[WORKER]...")
def shard(config: str, data_path: str | None, out_dir: str, n_workers: int | None,
          among_named: bool, as_json: bool, force: bool, workers: tuple[str, ...]) -> None:
    """Cut each worker's share of a dataset into its own file, for a real cluster.

    Worker WORKER's file holds exactly the documents it would take from the dataset in
    `fedctl run` of the config's workers, as {text, label} lines; copy it to the worker's node
    and name it in workers[].data or `fedctl worker --data`. Name workers to write only
    their files (default: every worker's). Files whose content did not change are left
    alone; a file of that name this command did not write (your own documents) stops it
    unless --force. A shard its worker could not use (one-vs-rest without the positive
    class) stops the command before anything is written.
    """
    from common.config import ConfigError, load_config
    from common.data.shards import write_shards

    try:
        cfg = load_config(config)
        if n_workers is not None:
            cfg = cfg.with_workers(n_workers)
        if data_path is not None:
            cfg.data.path = str(Path(data_path).resolve())
        report = write_shards(cfg, out_dir, list(workers) or None, among_named=among_named,
                              force=force)
    except (ConfigError, DataError) as exc:
        raise _fail(exc) from None
    except OSError as exc:
        raise _fail(f"{out_dir}: cannot write ({exc.strerror or exc})") from None
    if as_json:
        click.echo(json.dumps({"sizes": report.sizes, "written": report.written,
                               "unchanged": report.unchanged}))
        return
    for name, n in report.sizes.items():
        state = "written" if name in report.written else "unchanged"
        click.echo(f"{Path(out_dir) / (name + '.jsonl')}: {n} documents ({state})")
