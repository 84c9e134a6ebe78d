"""The figures of the book, one module per part: they take results and draw them, nothing else.

Every figure draws an all-reduce algorithm in the same colour (:func:`algorithm_colour`): the
ring blue, the tree orange, the naive all-reduce green, the library's (``dist.all_reduce``) grey,
in chapters 5, 6 and 10 alike.

Chapter 1: the plots of every chapter (each module names its own).
"""

from __future__ import annotations

__all__ = ["ALGORITHM_COLOURS", "algorithm_colour"]

# One colour per algorithm across the book (matplotlib's tab10 colours). The flat ring of
# chapter 10 is the ring; the library's all-reduce, the yardstick, is grey.
ALGORITHM_COLOURS = {
    "halving-doubling": "#9467bd",
    "two-level": "#8c564b",
    "library": "#7f7f7f",
    "ring": "#1f77b4",
    "tree": "#ff7f0e",
    "naive": "#2ca02c",
}
# What else a figure calls them (the functions' names, chapter 5's broadcast in a line).
_ALIASES = {"hierarchical": "two-level", "dist.all_reduce": "library", "line": "naive"}


def algorithm_colour(name: str) -> str:
    """The colour of the all-reduce (or broadcast) that ``name`` names: ``"ring"``,
    ``"ring_all_reduce"``, ``"flat ring"``, ``"ring posted ahead"`` are all the ring's. Raises
    ``KeyError`` for a name that names none, so that a new algorithm gets a colour of its own."""
    lowered = name.lower()
    for key in (*ALGORITHM_COLOURS, *_ALIASES):  # the longer names first: "two-level" has no ring
        if key in lowered:
            return ALGORITHM_COLOURS[_ALIASES.get(key, key)]
    raise KeyError(f"no colour for the algorithm {name!r}: add it to ALGORITHM_COLOURS")
