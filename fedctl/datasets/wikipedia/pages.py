"""Reading the Wikipedia APIs' answers: pages from ``prop=extracts``, scores from Lift Wing.

:class:`ExtractsAnswer` gathers the responses of one extracts query (its continuations
included) and says, for each requested title, which :class:`Page` it led to;
:func:`parse_topic_scores` takes the topic probabilities out of a Lift Wing response. Both are
lenient about formatversion 1 and 2 and about missing pieces, since mirrors differ.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from fedctl.datasets.wikipedia.errors import RequestFailed, one_line

__all__ = ["Page", "ExtractsAnswer", "parse_topic_scores"]

#: The API resolves one redirect hop; following a few more costs nothing and helps mirrors.
_MAX_REDIRECT_HOPS = 5


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


def _from_to(items: Any) -> Iterator[tuple[str, str]]:
    """``(from, to)`` of each well-formed entry of a ``normalized``/``redirects`` list."""
    for item in items or []:
        if isinstance(item, dict) and "from" in item and "to" in item:
            yield str(item["from"]), str(item["to"])


def _fill_page(page: Page, info: dict[str, Any]) -> None:
    """Set ``page``'s state, ids, text and disambiguation flag from its merged API entry."""
    if _flag(info, "invalid"):
        page.invalid = one_line(info.get("invalidreason") or "invalid title")
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


@dataclass
class ExtractsAnswer:
    """The responses of one ``prop=extracts|info|pageprops`` query, merged.

    Attributes
    ----------
    renamed : dict of str to str
        Requested title -> its normalized or converted (language variant) form.
    redirects : dict of str to str
        Redirect title -> its target.
    pages : dict of str to dict
        Final title -> the page's properties, merged over the continuations.
    interwiki : set of str
        Requested titles that point at another wiki.
    """

    renamed: dict[str, str] = field(default_factory=dict)
    redirects: dict[str, str] = field(default_factory=dict)
    pages: dict[str, dict[str, Any]] = field(default_factory=dict)
    interwiki: set[str] = field(default_factory=set)

    def add(self, query: Any) -> None:
        """Take in the ``query`` member of one response (ignored unless a JSON object)."""
        if not isinstance(query, dict):
            return
        for kind in ("normalized", "converted"):
            self.renamed.update(_from_to(query.get(kind)))
        self.redirects.update(_from_to(query.get("redirects")))
        self.interwiki.update(str(item["title"]) for item in query.get("interwiki") or []
                              if isinstance(item, dict) and "title" in item)
        # Continuations repeat each page with only the properties still to come: merge.
        for page in _pages_of(query):
            merged = self.pages.setdefault(page["title"], {})
            merged.update({k: v for k, v in page.items() if v is not None})

    def page_for(self, requested: str) -> Page:
        """The page that title ``requested`` leads to, after normalization and redirects."""
        if requested in self.interwiki:
            return Page(title=requested, invalid="interwiki title")
        title = self.renamed.get(requested, requested)
        was_normalized = title != requested
        hops = 0
        while title in self.redirects and hops < _MAX_REDIRECT_HOPS:
            title, hops = self.redirects[title], hops + 1
        page = Page(title=title, normalized=was_normalized, redirected=hops > 0)
        info = self.pages.get(title)
        if info is None:
            page.missing = True
        else:
            _fill_page(page, info)
        return page


def _revision_probabilities(scores: dict[str, Any], revid: int) -> dict[str, float]:
    """The probabilities of revision ``revid`` in one wiki's ``scores`` object.

    A lone entry is taken whatever its key, and a lone model whatever its name, since mirrors
    label them differently.
    """
    entry = scores.get(str(revid))
    if entry is None and len(scores) == 1:
        entry = next(iter(scores.values()))
    if not isinstance(entry, dict):
        raise RequestFailed(f"topic API: no scores for revision {revid}")
    model = entry.get("articletopic")
    if model is None and len(entry) == 1:
        model = next(iter(entry.values()))
    if isinstance(model, dict) and "error" in model:
        raise RequestFailed(f"topic API error: {one_line(model['error'])}")
    probs = (model or {}).get("score", {}).get("probability") if isinstance(
        model, dict) else None
    if not isinstance(probs, dict) or not probs:
        raise RequestFailed(f"topic API: no probabilities for revision {revid}")
    try:
        return {str(k): float(v) for k, v in probs.items()}
    except (TypeError, ValueError):
        raise RequestFailed("topic API: a probability is not a number") from None


def parse_topic_scores(obj: Any, revid: int) -> dict[str, float]:
    """All topic probabilities from a Lift Wing ``articletopic`` response.

    Accepts ``{"<wiki>": {"scores": {"<revid>": {"articletopic": {"score": {"probability":
    {label: p}}}}}}}``; the wiki key is not assumed to be ``enwiki``.

    Parameters
    ----------
    obj : Any
        The parsed response body.
    revid : int
        The revision that was scored.

    Returns
    -------
    dict of str to float
        Topic label -> probability.

    Raises
    ------
    RequestFailed
        If the model reported an error for the revision or the shape is not as above.
    """
    if not isinstance(obj, dict):
        raise RequestFailed("topic API: response is not a JSON object")
    if "error" in obj and not any(isinstance(v, dict) and "scores" in v for v in obj.values()):
        raise RequestFailed(f"topic API error: {one_line(obj['error'])}")
    for wiki in obj.values():
        if isinstance(wiki, dict) and isinstance(wiki.get("scores"), dict):
            return _revision_probabilities(wiki["scores"], revid)
    raise RequestFailed("topic API: response has no 'scores'")
