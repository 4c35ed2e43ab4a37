"""The commands that use what was trained: ``fedctl predict``, ``topics``, ``show`` and ``runs``.

Each takes a run folder (``runs/latest``, ``runs/<UTC time>-<id>``, or any ``output_dir``) and
never starts a cluster.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import click

from common import constants as C
from common.atomic import atomic_write_bytes
from common.data.reading import TABLE_DELIMITERS, read_table, text_problem
from fedctl.errors import fail

_run_arg = click.argument("run", type=click.Path(exists=True, file_okay=False),
                          default="runs/latest")




class _Document(NamedTuple):
    line: int  # in INPUT, from 1: blank lines are skipped, and this matches an output to its line
    text: str
    id: Any  # a JSONL line's own "id", passed through (None: it has none)


#: Extensions that say JSONL whatever the first line looks like (case aside).
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")


def _read_texts(path: str) -> list[_Document]:
    """The ``text`` of every line of a JSONL file, or every line of a plain-text file (one
    document a line); ``-`` is standard input.

    JSONL is told by the extension (:data:`JSONL_SUFFIXES`) or, whatever the name (a pipe, a
    ``.txt``), by a first non-blank line that is a JSON object (each must then have a
    ``"text"`` string): read as plain text, each whole JSON line, its label included, would
    be embedded instead.
    """
    if path == "-":
        data = sys.stdin.buffer.read()  # (click's get_binary_stream is deprecated)
    else:
        with open(path, "rb") as fh:
            data = fh.read()
    data = data.removeprefix(b"\xef\xbb\xbf")  # a byte-order mark is not text
    lines: list[tuple[int, str]] = []
    # Line by line, so that an error names its line (the whole file decoded at once would
    # only say at which byte).
    for n, raw in enumerate(data.splitlines(), 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"{path}:{n}: not UTF-8 text ({exc.reason})") from None
        if line.strip():
            lines.append((n, line))
    if not lines:
        raise ValueError(f"{path}: no documents")
    delimiter = TABLE_DELIMITERS.get(Path(path).suffix.lower()) if path != "-" else None
    if delimiter is not None:
        return _read_table(path, data.decode("utf-8"), delimiter)
    jsonl = path.lower().endswith(JSONL_SUFFIXES) or _is_json_object(lines[0][1])
    if not jsonl:
        return [_Document(n, line, None) for n, line in lines]
    docs = []
    for n, line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{n}: not JSON ({exc.msg}, column {exc.colno}); the "
                             f"file is read as JSONL") from None
        if not isinstance(row, dict) or not isinstance(row.get("text"), str):
            raise ValueError(f"{path}:{n}: expected an object with a \"text\" string")
        for field in ("text", "id"):
            if isinstance(row.get(field), str) and (problem := text_problem(row[field])):
                raise ValueError(f"{path}:{n}: field {field!r} is {problem}")
        docs.append(_Document(n, row["text"], row.get("id")))
    return docs


def _read_table(path: str, text: str, delimiter: str) -> list[_Document]:
    """The ``text`` column of a CSV or TSV file with a header (and its ``id`` column, if
    any); each document's line is the one its row begins on."""
    header, rows = read_table(path, text, delimiter)
    if "text" not in header:
        raise ValueError(f"{path}:1: expected a header naming a \"text\" column (found: "
                         f"{', '.join(h for h in header if h)[:200] or 'none'})")
    at, id_at = header.index("text"), header.index("id") if "id" in header else None
    docs = []
    for line, row in rows:
        if len(row) <= at:
            raise ValueError(f"{path}:{line}: {len(row)} column(s), no \"text\" "
                             f"(column {at + 1})")
        given = row[id_at] if id_at is not None and id_at < len(row) else ""
        docs.append(_Document(line, row[at], given or None))  # (an empty id: none)
    if not docs:
        raise ValueError(f"{path}: no documents below its header")
    return docs


def _is_json_object(line: str) -> bool:
    """A line that is a JSON object: JSONL, whose objects must then have a "text" (one
    without, piped in, was embedded whole as a document, its id dropped, in silence)."""
    if not line.lstrip().startswith("{"):
        return False
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        return False
    return isinstance(row, dict)


@click.command()
@click.argument("run", type=click.Path(exists=True, file_okay=False))
@click.argument("input_path", metavar="INPUT",
                type=click.Path(exists=True, dir_okay=False, allow_dash=True))
@click.option("--output", "-o", type=click.Path(dir_okay=False, allow_dash=True), default=None,
              help="Where to write one JSON line per document (default, or -: standard "
                   "output).")
@click.option("--progress/--no-progress", default=True, show_default=True,
              help="A progress bar while embedding.")
def predict(run: str, input_path: str, output: str | None, progress: bool) -> None:
    """Apply RUN's trained model to the documents of INPUT (JSONL with a "text" field, or
    plain text, one document a line; - reads standard input), e.g.
    `fedctl predict runs/latest docs.jsonl -o out.jsonl`. JSONL is told by the extension
    (.jsonl, .json, .ndjson) or by a first line that is a JSON object; a
    .csv or .tsv file is a table whose header names a "text" column (and maybe an "id").

    Writes one JSON line per document, in order, with its line in INPUT (and a JSONL
    line's or table row's "id", if it has one): the MLP's label and class probabilities;
    FSTC's cluster and its probabilities; a topic model's mixture and top topics with their
    words.
    """
    if not progress:  # quiet means quiet: a fine-tuned encoder's loading bar too (read by
        # transformers from the hub's switch when it is first imported)
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        from fedctl.inference import ModelError, load_model

        if output == "-":
            output = None
        if (output is not None and input_path != "-"
                and Path(output).resolve() == Path(input_path).resolve()):
            raise ValueError(f"--output {output}: that is INPUT; the predictions would replace "
                             f"the documents")
        if output is not None:  # checked before the documents are embedded, not after
            _check_not_the_runs_own(Path(output), Path(run))
            _check_writable(Path(output))
        docs = _read_texts(input_path)
        model = load_model(run)
        # A named file is kept in the embedding cache: the next model scored on the same
        # documents costs no embedding. What is piped in passes once.
        model.keep_embeddings = input_path != "-"
        _warn_if_failed(run)
        # All at once: the embeddings are cached under the whole list, so a file the cluster
        # trained on costs no embedding at all.
        records = model.records([d.text for d in docs], progress=progress)
        lines = [json.dumps({"line": d.line, **({} if d.id is None else {"id": d.id}), **r})
                 for d, r in zip(docs, records, strict=True)]
    except (OSError, ValueError, ModelError) as exc:  # (an unwritable cache folder too)
        fail(exc)
    except (TypeError, AttributeError, KeyError) as exc:  # a field of model.json of another type
        fail(_damaged(run, exc))
    data = "".join(line + "\n" for line in lines).encode()
    if output is None:
        click.echo(data.decode(), nl=False)
    else:
        try:
            atomic_write_bytes(Path(output), data)
        except OSError as exc:  # no room, no permission
            fail(OSError(f"--output {output}: cannot write ({exc.strerror or exc})"))
        click.echo(f"{len(lines)} predictions written to {output}", err=True)


def _damaged(run: str, exc: BaseException) -> ValueError:
    """A run folder whose files hold fields of another type than fedctl writes (a hand edit,
    someone else's file), in one line."""
    return ValueError(f"{run}: its files are not as fedctl writes them "
                      f"({type(exc).__name__}: {str(exc)[:120]})")


def _warn_if_failed(run: str) -> None:
    """A run that failed after writing its model (killed during its final reports) is used,
    but not in silence."""
    from fedctl.runs import failed_note

    why = failed_note(run)
    if why is not None:
        click.echo(f"warning: {run}: its run failed ({why}); this is the model it had written",
                   err=True)


def _check_not_the_runs_own(path: Path, run: Path) -> None:
    """Refuse an output that is one of RUN's own files (``-o runs/x/model.json`` wrote the
    predictions over the model, and the run could no longer be used)."""
    try:
        inside = path.resolve().relative_to(run.resolve())
    except ValueError:
        return  # not in the run's folder
    from fedctl.run import RUN_FILES  # what a run writes in its folder, files and folders

    if inside.parts and inside.parts[0] in RUN_FILES:
        raise ValueError(f"--output {path}: that is {run}'s own "
                         f"{'file' if len(inside.parts) == 1 else 'folder'} "
                         f"({inside.parts[0]}); name another file, e.g. "
                         f"{run}/predictions.jsonl")


def _check_writable(path: Path) -> None:
    """Refuse an output path under a file, or in a folder that cannot be written (missing
    folders are made when the file is written)."""
    folder = path.resolve().parent
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        raise ValueError(f"--output {path}: {folder} is a file, not a folder")
    if not os.access(folder, os.W_OK):
        raise ValueError(f"--output {path}: cannot write in {folder}")


@click.command()
@_run_arg
@click.option("-n", "n_words", type=click.IntRange(min=1), default=10, show_default=True,
              help="Words per topic.")
def topics(run: str, n_words: int) -> None:
    """Print each topic's top words (the topic families: nmf, prodlda, combinedtm, lda,
    sentencelda). RUN defaults to runs/latest, e.g. `fedctl topics runs/latest -n 15`."""
    try:
        from fedctl.inference import ModelError, TopicModel, load_model

        model = load_model(run)
        _warn_if_failed(run)
        if not isinstance(model, TopicModel):
            raise ModelError(f"{run}: family {model.family} has no topics (a {model.kind})")
    except (FileNotFoundError, ValueError) as exc:
        fail(exc)
    heads = model.get_topics(n_words)
    width = len(str(len(heads) - 1))
    for k, words in enumerate(heads):
        click.echo(f"topic {k:>{width}}: {' '.join(words)}")


@click.command()
@_run_arg
def show(run: str) -> None:
    """Print what RUN was and what it gave: family, configuration, rounds, wall time, final
    scores and the comparison table. RUN defaults to runs/latest, e.g. `fedctl show`, or
    `fedctl show runs/20261129T061212Z-1a2b3c.failed` for why a run failed."""
    try:
        _show(run)
    except (TypeError, AttributeError, KeyError) as exc:  # summary.json's fields of other types
        fail(_damaged(run, exc))


def _show(run: str) -> None:
    folder = Path(run)
    try:
        from fedctl.runs import failed_note, load_run, strategy_name, wall_time

        r = load_run(folder)
    except FileNotFoundError as exc:  # no model: a failed, stopped or running run's own story
        if not _show_unfinished(folder):
            fail(exc)
        return
    except ValueError as exc:
        fail(exc)
    s = r.summary or {}
    cfg = r.config
    wall = wall_time(folder)
    click.echo(f"run {s.get('run_id', '?')} in {folder.resolve()}")
    why = failed_note(folder) or s.get("failed")
    if why:
        click.echo(f"FAILED: {why}")
    click.echo(f"family {r.family} ({json.dumps(r.model.get('params') or cfg.family_params)}), "
               f"strategy {strategy_name(cfg)}, {len(cfg.workers)} worker(s): "
               f"{', '.join(w.name for w in cfg.workers)}")
    trained = s.get("trained", "?")
    if isinstance(trained, dict):  # {"rounds": 10, "steps": 2}: "10 rounds, 2 steps"
        trained = ", ".join(f"{v} {k.removesuffix('s') if v == 1 else k}"
                            for k, v in trained.items())
    click.echo(f"rounds {s.get('rounds', '?')}, trained {trained}, "
               f"wall time {'-' if wall is None else f'{wall:.1f} s'}, "
               f"data {cfg.data.path} ({cfg.data.task}, {cfg.data.partition})")
    from master.outputs import privacy_spent

    privacy = s.get("privacy") or {}
    spent = privacy_spent(privacy)
    if spent:  # what a private run spent: the first thing its reader asks
        delta = privacy.get("delta")
        click.echo(f"privacy: {', '.join(spent)}"
                   + (f", δ {delta:g}" if isinstance(delta, int | float) else ""))
    if isinstance(s.get("laplace_epsilon"), int | float):
        click.echo(f"privacy: Laplace noise of ε {s['laplace_epsilon']:g} on each party's "
                   f"document–topic counts (iFTM)")
    if s.get("refused"):
        click.echo(f"refused requests: {s['refused']}")
    if s.get("excluded"):
        click.echo(f"excluded workers: {s['excluded']}")
    table = folder / "comparison.md"
    if table.is_file():
        click.echo("")
        click.echo(table.read_text().rstrip())


def _show_unfinished(folder: Path) -> bool:
    """What a run folder without a model says of its run (False: it is no run folder): its
    state, why it failed, its job and the rounds it did, and how to go on where it can."""
    from common.config import load_config
    from common.runlog import read_metrics
    from fedctl.runs import RUN_MARKS, failed_note, run_state, strategy_name

    if not folder.is_dir() or not any((folder / m).is_file() for m in RUN_MARKS):
        return False
    try:
        cfg = load_config(folder / "cluster.yaml")
        events = (read_metrics(folder / "metrics.jsonl")
                  if (folder / "metrics.jsonl").is_file() else [])
    except Exception:  # a folder half-written by a run still starting: the one-line error
        return False
    state = run_state(folder)["state"]
    done = max((e["round"] for e in events
                if e.get("event") == "round" and isinstance(e.get("round"), int)), default=0)
    click.echo(f"run in {folder.resolve()}: {state}, no model")
    # fedctl run's note, else the master's own word (a master alone fails without a note)
    why = failed_note(folder) or next((str(e.get("reason")) for e in reversed(events)
                                       if e.get("event") == "failed"), None)
    if why:
        click.echo(f"FAILED: {why}")
    click.echo(f"family {cfg.family} ({json.dumps(cfg.family_params)}), strategy "
               f"{strategy_name(cfg)}, {len(cfg.workers)} worker(s): "
               f"{', '.join(w.name for w in cfg.workers)}")
    click.echo(f"rounds done {done} of {cfg.rounds}, data {cfg.data.path} ({cfg.data.task}, "
               f"{cfg.data.partition})")
    if "resumable" in state:
        config = folder / "cluster.yaml"
        click.echo(f"continue with: fedctl master --config {config} --resume, and its workers "
                   f"(fedctl worker --config {config} --id <worker>)")
    if (folder / "logs").is_dir():
        click.echo(f"logs: {folder / 'logs'}")
    return True


@click.command("runs")
@click.argument("folder", type=click.Path(file_okay=False), default="runs")
def runs_cmd(folder: str) -> None:
    """List the runs in FOLDER (default runs/), newest last: when each started, family,
    workers, rounds, headline score, wall time, and whether it finished, e.g. `fedctl runs`,
    then `fedctl show RUN` for one of them."""
    from fedctl.runs import list_runs

    root = Path(folder)
    if not root.exists() and root != Path("runs"):  # (no runs/ yet is no runs, below)
        fail(FileNotFoundError(f"{folder}: no such folder"))
    found = list_runs(root)  # a damaged run is listed as such, not a traceback
    if not found:
        click.echo(f"{root}: no runs")
        return
    latest = (root / "latest").resolve() if (root / "latest").exists() else None
    # (An unfinished run's rounds read "40/50": the column is as wide as its widest.)
    width = max(6, *(len(str(e["rounds"])) for e in found))
    name = max(24, *(len(e["path"].name) for e in found))  # ".failed" and ".partial" too
    header = f"{'run':<{name}} {'started':<16} {'family':<11} {'workers':>7} {'rounds':>{width}} " \
             f"{'score':<20} {'wall':>8}  state"
    click.echo(header)
    for entry in found:
        mark = " (latest)" if latest is not None and entry["path"].resolve() == latest else ""
        wall = "-" if entry["wall_s"] is None else f"{entry['wall_s']:.1f}s"
        when = ("-" if entry["started"] is None else  # local time, as the user reads a clock
                time.strftime("%Y-%m-%d %H:%M", time.localtime(entry["started"])))
        click.echo(f"{entry['path'].name:<{name}} {when:<16} {entry['family']:<11} "
                   f"{entry['workers']:>7} {entry['rounds']:>{width}} {entry['score']:<20} "
                   f"{wall:>8}  {entry['state']}{mark}")


@click.command()
@click.argument("runs", nargs=-1, required=True,
                type=click.Path(exists=True, file_okay=False))
@click.option("--output", "-o", type=click.Path(dir_okay=False), default="curves.png",
              show_default=True, help="The picture to write (PNG).")
@click.option("--title", default=None, help="The picture's title.")
def plot(runs: tuple[str, ...], output: str, title: str | None) -> None:
    """Draw the learning curves of one run or more on each other, e.g. two strategies:
    `fedctl plot runs/A runs/B -o compare.png`. Runs that differ only by seed are drawn as
    their mean with a band from the lowest to the highest."""
    from matplotlib.backend_bases import FigureCanvasBase

    from fedctl.plots import plot_runs

    for r in runs:
        if not (Path(r) / "metrics.jsonl").is_file():
            note = Path(r) / C.FAILED_NOTE
            fail(FileNotFoundError(
                f"{r}: a run that failed before it recorded anything, nothing to draw "
                f"({note.read_text(errors='replace').strip()[:200]})" if note.is_file()
                else f"{r}: no metrics.jsonl (not a fedctl run)"))
    kinds = FigureCanvasBase.get_supported_filetypes()
    suffix = Path(output).suffix.lstrip(".").lower()
    if suffix not in kinds:
        fail(ValueError(f"--output {output}: a picture's name ends in one of "
                         f".{', .'.join(sorted(kinds))}"))
    if not Path(output).resolve().parent.is_dir():
        fail(FileNotFoundError(f"--output {output}: no folder {Path(output).parent}"))
    target = Path(output).resolve()
    if (target.name == "curves.png" and (target.parent / "metrics.jsonl").is_file()
            and [Path(r).resolve() for r in runs] != [target.parent]):
        # (`fedctl plot runs/A runs/B` from inside a run folder: its own curves, replaced)
        fail(ValueError(f"--output {output}: that is the run {target.parent}'s own "
                        f"curves.png; name another file, e.g. -o compare.png"))
    try:
        click.echo(f"wrote {plot_runs(runs, output, title)}")
    except (OSError, ValueError) as exc:
        fail(exc)
    except (TypeError, AttributeError, KeyError) as exc:  # a field of another type
        fail(_damaged(", ".join(runs), exc))


#: ``fedctl init --family NAME``: the example each family starts from.
STARTERS = {"mlp": "mlp_multiclass.yaml", "nmf": "nmf_mi_fedadam.yaml",
            "prodlda": "prodlda_sync.yaml", "combinedtm": "combinedtm.yaml", "fstc": "fstc.yaml",
            "lda": "lda_privacy.yaml", "sentencelda": "sentencelda.yaml"}
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@click.command()
@click.option("--family", "-f", type=click.Choice(sorted(STARTERS)), default="mlp",
              show_default=True, help="The model family to start with.")
@click.option("--output", "-o", type=click.Path(dir_okay=False), default="cluster.yaml",
              show_default=True, help="Where to write the configuration.")
@click.option("--force", is_flag=True, help="Replace an existing file.")
def init(family: str, output: str, force: bool) -> None:
    """Write a starter configuration for a model family: a commented, working cluster.yaml
    (the family's example from examples/, its paths made relative to where it is written).
    Then: `fedctl check`, `fedctl run`."""
    target = Path(output)
    if target.exists() and not force:
        fail(FileExistsError(f"{target}: exists (use --force to replace it)"))
    source = EXAMPLES / STARTERS[family]
    if not source.is_file():
        fail(FileNotFoundError(f"{source}: the examples are not installed with this copy"))
    text = source.read_text()
    # The bundled data: relative to the new file inside the project, absolute outside it; the
    # runs go beside the new file.
    data, here = EXAMPLES.parent / "data", target.resolve().parent
    inside = here == EXAMPLES.parent or EXAMPLES.parent in here.parents
    text = text.replace("../data/", (os.path.relpath(data, here) if inside else str(data)) + "/")
    text = text.replace("../runs/", "runs/")
    # Its header's "Run:" line names the new file, not the example it came from; its "Then:"
    # paths are from here, where the user types them: the runs beside the new file, the
    # bundled data where it is.
    text = text.replace(f"--config examples/{source.name}", f"--config {target}")
    runs_here = _from_here(target.resolve().parent / "runs" / "latest")
    data_here = _from_here(data)
    text = "".join(
        line.replace(" runs/latest", f" {runs_here}").replace(" data/", f" {data_here}/")
        if line.startswith("#") else
        line.replace("   # relative to this file", "") if not inside else line
        for line in text.splitlines(keepends=True))
    try:
        atomic_write_bytes(target, text.encode())
    except OSError as exc:  # a folder not writable, a path through a file
        file = next((p for p in target.parents if p.exists() and not p.is_dir()), None)
        fail(OSError(f"{target}: cannot write ("
                     + (f"{file} is a file, not a folder" if file else exc.strerror or str(exc))
                     + ")"))
    click.echo(f"wrote {target} ({family}, from examples/{source.name}); next: "
               f"fedctl check --config {target} && fedctl run --config {target}")


def _from_here(path: Path) -> str:
    """``path`` as typed from the working folder: relative below it, absolute elsewhere."""
    rel = os.path.relpath(path)
    return str(path) if rel == ".." or rel.startswith("../") else rel


COMMANDS = (predict, topics, show, runs_cmd, plot, init)
