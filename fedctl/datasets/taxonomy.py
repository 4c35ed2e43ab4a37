"""The 64 topic labels of the English Wikipedia ``articletopic`` model (ORES / Lift Wing).

The labels form the WikiProject-derived topic taxonomy: four top-level groups (Culture,
Geography, History and Society, STEM), written with dots, e.g. ``STEM.Technology`` or
``Geography.Regions.Europe.Northern Europe``. Labels ending in ``*`` are catch-all parents.

Source: the model card ``model_info/enwiki.articletopic.md`` of wikimedia/drafttopic (MIT),
snapshot 7ff9313f4a5de4730968f37947973b7f4674f64b (model version 1.3.0). Only the label names
are taken; ``tests/fixtures/wikipedia/enwiki_articletopic_labels.tsv`` keeps the full table with
its attribution, and a test checks that the two agree.
"""

from __future__ import annotations

import difflib

__all__ = ["ARTICLETOPIC_LABELS", "DEFAULT_TOPIC", "check_topic"]

#: Every label the ``enwiki-articletopic`` model scores, in the model card's order.
ARTICLETOPIC_LABELS: tuple[str, ...] = (
    "Culture.Biography.Biography*",
    "Culture.Biography.Women",
    "Culture.Food and drink",
    "Culture.Internet culture",
    "Culture.Linguistics",
    "Culture.Literature",
    "Culture.Media.Books",
    "Culture.Media.Entertainment",
    "Culture.Media.Films",
    "Culture.Media.Media*",
    "Culture.Media.Music",
    "Culture.Media.Radio",
    "Culture.Media.Software",
    "Culture.Media.Television",
    "Culture.Media.Video games",
    "Culture.Performing arts",
    "Culture.Philosophy and religion",
    "Culture.Sports",
    "Culture.Visual arts.Architecture",
    "Culture.Visual arts.Comics and Anime",
    "Culture.Visual arts.Fashion",
    "Culture.Visual arts.Visual arts*",
    "Geography.Geographical",
    "Geography.Regions.Africa.Africa*",
    "Geography.Regions.Africa.Central Africa",
    "Geography.Regions.Africa.Eastern Africa",
    "Geography.Regions.Africa.Northern Africa",
    "Geography.Regions.Africa.Southern Africa",
    "Geography.Regions.Africa.Western Africa",
    "Geography.Regions.Americas.Central America",
    "Geography.Regions.Americas.North America",
    "Geography.Regions.Americas.South America",
    "Geography.Regions.Asia.Asia*",
    "Geography.Regions.Asia.Central Asia",
    "Geography.Regions.Asia.East Asia",
    "Geography.Regions.Asia.North Asia",
    "Geography.Regions.Asia.South Asia",
    "Geography.Regions.Asia.Southeast Asia",
    "Geography.Regions.Asia.West Asia",
    "Geography.Regions.Europe.Eastern Europe",
    "Geography.Regions.Europe.Europe*",
    "Geography.Regions.Europe.Northern Europe",
    "Geography.Regions.Europe.Southern Europe",
    "Geography.Regions.Europe.Western Europe",
    "Geography.Regions.Oceania",
    "History and Society.Business and economics",
    "History and Society.Education",
    "History and Society.History",
    "History and Society.Military and warfare",
    "History and Society.Politics and government",
    "History and Society.Society",
    "History and Society.Transportation",
    "STEM.Biology",
    "STEM.Chemistry",
    "STEM.Computing",
    "STEM.Earth and environment",
    "STEM.Engineering",
    "STEM.Libraries & Information",
    "STEM.Mathematics",
    "STEM.Medicine & Health",
    "STEM.Physics",
    "STEM.STEM*",
    "STEM.Space",
    "STEM.Technology",
)

DEFAULT_TOPIC = "STEM.Technology"

_LABEL_SET = frozenset(ARTICLETOPIC_LABELS)


def check_topic(name: str) -> str:
    """Return ``name`` if it is one of the 64 labels, else raise with the closest matches.

    Parameters
    ----------
    name : str
        A label as the API writes it, e.g. ``"STEM.Technology"``. Case and spaces matter; a
        surrounding blank is forgiven.

    Returns
    -------
    str
        The label, stripped.

    Raises
    ------
    ValueError
        One line naming the bad topic and up to three close labels (or a few examples).
    """
    label = name.strip()
    if label in _LABEL_SET:
        return label
    # Case-insensitive and underscore-for-space matches first: "stem.technology" and the
    # outlink model's "STEM.Earth_and_environment" spelling are common slips.
    folded = {lab.lower(): lab for lab in ARTICLETOPIC_LABELS}
    key = label.replace("_", " ").lower()
    close = [folded[key]] if key in folded else difflib.get_close_matches(
        label, ARTICLETOPIC_LABELS, n=3, cutoff=0.6
    )
    if close:
        hint = f"did you mean: {', '.join(close)}?"
    else:
        hint = "e.g. STEM.Technology, STEM.Computing, Culture.Sports"
    raise ValueError(f"unknown topic '{name}': not one of the 64 articletopic labels ({hint})")
