"""Benchmark overlap: a prompt text against every benchmark item, by four rules (the first that holds is named).

1. ``exact``: a prompt message's text equals a benchmark text.
2. ``whitespace``: equal once both have every run of whitespace made one space and their ends stripped.
3. ``normalized``: equal once both are reduced to their words (:func:`words`: lower-cased ``\\w+`` runs; case,
   punctuation and whitespace ignored). This is what catches a short item (fewer than ``n`` words, no n-gram)
   copied with other case or punctuation.
4. ``<n>-gram``: the prompt shares at least ``min_shared`` distinct word ``n``-grams with one benchmark item
   (GPT-3's contamination study, Brown et al. 2020, appendix C: 13-grams, one shared n-gram is enough), not
   counting boilerplate: an n-gram found in :data:`BOILERPLATE_ITEMS` or more benchmark items (a common traceback
   line, a test harness's header) is no evidence that a prompt copies any one of them. A benchmark item with
   fewer than ``n`` words has no n-gram: only rules 1 to 3 can match it (a very short item would otherwise match
   any prompt that happens to contain its few words). The detail names one n-gram the prompt shares with the item.

Items are matched in the order the config lists the benchmarks, then file order: a prompt that overlaps several
items is named after the first that the first rule to hold matches; for rule 3, the item sharing the most n-grams
(the first such on a tie).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Sequence

from .benchmarks import BenchmarkItem

_WORD = re.compile(r"\w+")
#: an n-gram found in this many benchmark items or more is boilerplate: it matches no item by itself
BOILERPLATE_ITEMS = 3


def words(text: str) -> list[str]:
    """The words n-grams are made of: ``\\w+`` runs of the lower-cased text."""
    return _WORD.findall(text.lower())


def squash(text: str) -> str:
    """``text`` with every run of whitespace one space, ends stripped (the whitespace-normalised form)."""
    return " ".join(text.split())


def normalized(text: str) -> str:
    """``text`` reduced to its words, one space apart (case, punctuation and whitespace ignored)."""
    return " ".join(words(text))


def ngrams(ws: Sequence[str], n: int) -> set[tuple[str, ...]]:
    """The distinct word n-grams of ``ws`` (none when shorter than ``n``)."""
    return {tuple(ws[i : i + n]) for i in range(len(ws) - n + 1)}


@dataclass(frozen=True)
class Match:
    """Why a prompt is a benchmark overlap: the item, the rule (``exact``, ``whitespace``, ``normalized``,
    ``13-gram``) and, for the n-gram rule, how many n-grams it shares and one of them."""

    item: BenchmarkItem
    rule: str
    shared: int = 0
    example: tuple[str, ...] = ()

    def detail(self) -> str:
        """The reject detail: ``<benchmark> <item id> (<rule>[: N shared, e.g. '<n-gram>'])``, the n-gram the first
        one shared in the prompt's reading order, e.g. ``humaneval HumanEval/0 (13-gram: 44 shared, e.g. 'from
        typing import list def has_close_elements numbers list float threshold float bool')``."""
        extra = f": {self.shared} shared, e.g. '{' '.join(self.example)}'" if self.shared else ""
        return f"{self.item.benchmark} {self.item.item_id} ({self.rule}{extra})"


class OverlapIndex:
    """Every benchmark item's texts, whitespace-normalised texts and word n-grams, for :meth:`match`."""

    def __init__(self, items: Iterable[BenchmarkItem], n: int, min_shared: int):
        if n < 1 or min_shared < 1:
            raise ValueError(f"n-gram rule: n and min_shared must be >= 1, got {n}, {min_shared}")
        self.n, self.min_shared = n, min_shared
        self.items: list[BenchmarkItem] = list(items)
        self.exact: dict[str, int] = {}
        self.squashed: dict[str, int] = {}
        self.normal: dict[str, int] = {}
        self.grams: dict[tuple[str, ...], list[int]] = {}
        for i, item in enumerate(self.items):
            item_grams: set = set()
            for t in item.texts:
                self.exact.setdefault(t, i)
                self.squashed.setdefault(squash(t), i)
                if words(t):
                    self.normal.setdefault(normalized(t), i)
                item_grams |= ngrams(words(t), n)
            for g in item_grams:
                self.grams.setdefault(g, []).append(i)
        #: the n-grams of :data:`BOILERPLATE_ITEMS` or more items: counted for none
        self.boilerplate = {g for g, its in self.grams.items() if len(its) >= BOILERPLATE_ITEMS}
        for g in self.boilerplate:
            del self.grams[g]

    def __len__(self) -> int:
        return len(self.items)

    def match(self, texts: Sequence[str]) -> Match | None:
        """The first rule that ``texts`` (a prompt's messages) meet against an item, or None."""
        for t in texts:
            if t in self.exact:
                return Match(self.items[self.exact[t]], "exact")
        for t in texts:
            i = self.squashed.get(squash(t))
            if i is not None:
                return Match(self.items[i], "whitespace")
        for t in texts:
            i = self.normal.get(normalized(t))
            if i is not None:
                return Match(self.items[i], "normalized")
        if not self.grams:
            return None
        prompt_grams: dict = {}  # the prompt's distinct n-grams in reading order (the detail names the first shared)
        for t in texts:
            ws = words(t)
            prompt_grams.update(dict.fromkeys(tuple(ws[i : i + self.n]) for i in range(len(ws) - self.n + 1)))
        shared: dict[int, int] = {}
        first: dict[int, tuple[str, ...]] = {}
        for g in prompt_grams:
            for i in self.grams.get(g, ()):
                shared[i] = shared.get(i, 0) + 1
                first.setdefault(i, g)
        if not shared:
            return None
        best = min(shared, key=lambda i: (-shared[i], i))
        if shared[best] >= self.min_shared:
            return Match(self.items[best], f"{self.n}-gram", shared[best], first[best])
        return None
