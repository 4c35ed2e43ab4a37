"""Reading text: JSON Lines files of ``{"text": ..., "label": ...}``, or CSV / TSV tables
with a header naming a ``text`` column (and a ``label`` one); labels are optional, since the
unsupervised families train on text alone. Also the targets a task makes of the labels."""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

TASKS = ("multiclass", "one_vs_rest")
#: Tables by their extension, and their delimiter: a header naming a "text" column (and a
#: "label", or for `predict` an "id"), read with the csv module (a CSV's quoted commas and line
#: breaks included; a TSV is not quoted).
TABLE_DELIMITERS = {".csv": ",", ".tsv": "\t"}


class DataError(ValueError):
    """Bad input data or settings; the message is one line, meant for the user."""


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------


@dataclass
class TextDataset:
    """Texts and their labels, in file order.

    Attributes
    ----------
    texts : list of str
    labels : list of str
        Integer labels in the file are converted with ``str()``; ``""`` for every row of an
        unlabelled file.
    path : Path or None, default None
        The file the rows came from.
    labelled : bool, default True
        False when the file has no labels at all.
    """

    texts: list[str]
    labels: list[str]
    path: Path | None = None
    labelled: bool = True

    def __len__(self) -> int:
        return len(self.texts)


def read_jsonl(path: str | Path, limit: int | None = None, seed: int = 0) -> TextDataset:
    """Read a JSON Lines file of ``{"text": str, "label": str | int}`` objects.

    Blank lines are skipped; other fields are ignored. ``label`` is optional, but a file has
    it on every row or on none (a file that mixes them is an error naming the first line that
    breaks the rule).

    Parameters
    ----------
    path : str or Path
        The file to read (UTF-8).
    limit : int or None, default None
        If given and smaller than the number of rows, keep a seeded random subset of ``limit``
        rows, in file order.
    seed : int, default 0
        Seed for the subset drawn when ``limit`` applies.

    Returns
    -------
    TextDataset

    Raises
    ------
    DataError
        If the file is missing or empty, a line is not a JSON object, a field is missing or has
        the wrong type, some rows have a label and others not, or ``limit`` < 1. Messages
        name the file and line, e.g. ``data/x.jsonl:17: missing field 'text'``.
    """
    p = Path(path)
    if limit is not None and limit < 1:
        raise DataError(f"{p}: limit must be at least 1, got {limit}")
    if p.suffix.lower() in TABLE_DELIMITERS and p.is_file():
        return _subset(*_read_labelled_table(p), p, limit, seed)
    if p.is_dir():
        raise DataError(f"{p}: a folder; expected a JSONL file (one document a line)")
    if not p.is_file():
        raise DataError(f"{p}: no such file")

    texts: list[str] = []
    labels: list[str] = []
    first: tuple[int, bool] | None = None  # the first row's line, and whether it had a label
    with p.open("rb") as fh:  # decoded line by line: an error names its line
        for lineno, raw in enumerate(fh, start=1):
            where = f"{p}:{lineno}"
            if lineno == 1:  # a byte-order mark (Windows editors write one) is not text
                raw = raw.removeprefix(b"\xef\xbb\xbf")
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(f"{where}: not UTF-8 text ({exc.reason} at byte "
                                f"{exc.start})") from None
            if not line.strip():
                continue
            text, label = _parse_row(line, where)
            if first is None:
                first = (lineno, label is not None)
            elif (label is not None) != first[1]:
                raise DataError(f"{where}: missing field 'label' (line {first[0]} has one)"
                                if first[1] else
                                f"{where}: field 'label' where line {first[0]} has none "
                                f"(label every row or none)")
            texts.append(text)
            labels.append(label or "")

    if not texts or first is None:
        raise DataError(f"{p}: empty file (no rows)")
    return _subset(texts, labels, first[1], p, limit, seed)


def _subset(texts: list[str], labels: list[str], labelled: bool, p: Path, limit: int | None,
            seed: int) -> TextDataset:
    """The dataset, or a seeded random subset of ``limit`` rows of it, in file order."""
    if limit is not None and limit < len(texts):
        keep = np.sort(np.random.default_rng(seed).choice(len(texts), size=limit, replace=False))
        texts = [texts[i] for i in keep]
        labels = [labels[i] for i in keep]
    return TextDataset(texts=texts, labels=labels, path=p, labelled=labelled)


def read_table(path: str | Path, text: str, delimiter: str
               ) -> tuple[list[str], list[tuple[int, list[str]]]]:
    """A CSV (``delimiter`` ``,``) or TSV (``\\t``) table with a header: the header's names
    (stripped, lower case) and each non-blank row with the line it begins on.

    Raises
    ------
    DataError
        No header, or a row the csv module cannot read (an unbalanced quote), naming the line.
    """
    # strict: an unbalanced quote is an error, not the next rows swallowed into one field; a
    # document as long as a JSONL line may be is a field as long.
    csv.field_size_limit(max(csv.field_size_limit(), len(text)))
    # A TSV has no quoting (a text may begin with "); a CSV's quotes hold commas and lines.
    quoting = csv.QUOTE_NONE if delimiter == "\t" else csv.QUOTE_MINIMAL
    reader = csv.reader(io.StringIO(text, newline=""), delimiter=delimiter, strict=True,
                        quoting=quoting)
    rows: list[tuple[int, list[str]]] = []
    try:
        header: list[str] = []
        while not any(h.strip() for h in header):  # blank lines before the header
            header = [h.strip().lower() for h in next(reader)]
        begins = reader.line_num + 1  # (a blank line is a row of its own: [])
        for row in reader:
            line, begins = begins, reader.line_num + 1
            if any(cell.strip() for cell in row):  # a blank line, as in plain text
                rows.append((line, row))
    except StopIteration:
        raise DataError(f"{path}: no documents") from None
    except csv.Error as exc:
        raise DataError(f"{path}:{reader.line_num}: not readable as a table ({exc})") from None
    return header, rows


def _read_labelled_table(p: Path) -> tuple[list[str], list[str], bool]:
    """A table's ``text`` column and its ``label`` one (every row's ``""`` without one)."""
    try:
        text = p.read_bytes().removeprefix(b"\xef\xbb\xbf").decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"{p}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    header, rows = read_table(p, text, TABLE_DELIMITERS[p.suffix.lower()])
    if "text" not in header:
        found = ", ".join(h for h in header if h)[:200] or "none"
        raise DataError(f"{p}:1: expected a header naming a \"text\" column (and a "
                        f"\"label\" one; found: {found})")
    at = header.index("text")
    label_at = header.index("label") if "label" in header else None
    texts, labels = [], []
    for line, row in rows:
        if len(row) <= at:
            raise DataError(f"{p}:{line}: {len(row)} column(s), no \"text\" (column {at + 1})")
        label = row[label_at].strip() if label_at is not None and label_at < len(row) else ""
        if label_at is not None and not label:
            raise DataError(f"{p}:{line}: no label (the header has a \"label\" column: label "
                            f"every row, or drop the column)")
        texts.append(row[at])
        labels.append(label)
    if not texts:
        raise DataError(f"{p}: empty file (no rows below its header)")
    return texts, labels, label_at is not None


def text_problem(text: str) -> str | None:
    """Why ``text`` is no text a model can read, or None: half of a character (a lone
    surrogate, which a JSON escape such as ``\\ud800`` decodes to, and UTF-8 cannot hold)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return (f"not valid text: half of a character (\\u{ord(text[exc.start]):04x}, a "
                f"lone surrogate) at character {exc.start}")
    return None


def _parse_row(line: str, where: str) -> tuple[str, str | None]:
    """One line's text and label (None when it has none); DataError naming ``where``."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        raise DataError(f"{where}: not valid JSON") from None
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object with 'text' (and 'label')")
    if "text" not in row:
        raise DataError(f"{where}: missing field 'text'")
    if not isinstance(row["text"], str):
        raise DataError(f"{where}: field 'text' must be a string")
    if problem := text_problem(row["text"]):
        raise DataError(f"{where}: field 'text' is {problem}")
    if "label" not in row:
        return row["text"], None
    label = row["label"]
    # bool is an int subclass, but a true/false label is almost surely a mistake.
    if isinstance(label, bool) or not isinstance(label, (str, int)):
        raise DataError(f"{where}: field 'label' must be a string or an integer")
    if problem := text_problem(str(label)):
        raise DataError(f"{where}: field 'label' is {problem}")
    return row["text"], str(label)


def make_task(
    labels: list[str], task: str = "multiclass", positive: str | None = None
) -> tuple[np.ndarray, list[str]]:
    """Turn string labels into integer targets.

    Parameters
    ----------
    labels : list of str
    task : str, default "multiclass"
        ``"multiclass"``: one class per distinct label, classes sorted.
        ``"one_vs_rest"``: classes ``["rest", positive]``; y is 1 where the label is ``positive``.
    positive : str or None, default None
        The positive class; required for ``"one_vs_rest"``.

    Returns
    -------
    y : np.ndarray
        int64 indices into ``classes``.
    classes : list of str

    Raises
    ------
    DataError
        Unknown task, no labels, or a positive class that is missing or not in the data.
    """
    if task not in TASKS:
        raise DataError(f"unknown task '{task}'; allowed: {', '.join(TASKS)}")
    if len(labels) == 0:
        raise DataError("no labels")
    if not any(labels):  # an unlabelled file: no classes, every target 0
        return np.zeros(len(labels), dtype=np.int64), []
    if task == "multiclass":
        classes = sorted(set(labels))
        index = {c: i for i, c in enumerate(classes)}
        return np.array([index[lab] for lab in labels], dtype=np.int64), classes

    if positive is None:
        raise DataError("task 'one_vs_rest' needs a positive class")
    positive = str(positive)
    present = sorted(set(labels))
    if positive not in present:
        raise DataError(
            f"positive class '{positive}' not in the data; labels are: {', '.join(present)}"
        )
    y = np.array([lab == positive for lab in labels], dtype=np.int64)
    return y, ["rest", positive]
