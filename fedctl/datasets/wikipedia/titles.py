"""Titles to fetch: from files of titles or article URLs, and from viewing-history exports."""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Iterable
from pathlib import Path
from urllib.parse import unquote, urlsplit

from common.data.reading import DataError

__all__ = ["clean_title", "dedupe", "is_plausible_title", "read_titles", "read_history"]

#: Characters MediaWiki never allows in a title.
_BAD_TITLE_CHARS = re.compile(r"[<>\[\]{}|\x00-\x1f\x7f]")
#: MediaWiki's limit on a title, in UTF-8 bytes.
_MAX_TITLE_BYTES = 255


def is_plausible_title(title: str) -> bool:
    """Whether MediaWiki could accept ``title`` at all (allowed characters, at most 255 bytes).

    Titles failing this are reported as invalid without being sent: a ``|`` in one would split
    the ``titles=`` parameter of its whole batch.
    """
    return not (_BAD_TITLE_CHARS.search(title)
                or len(title.encode("utf-8")) > _MAX_TITLE_BYTES)


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
