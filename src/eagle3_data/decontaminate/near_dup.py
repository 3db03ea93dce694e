"""Near-duplicate prompts across datasets (and, optionally, within one): MinHash signatures and an LSH index (``datasketch``).

A prompt's *shingles* are the distinct ``shingle``-word windows of its words (:func:`.overlap.words` of its user
and system messages; a prompt with fewer words is one shingle of them all, a prompt with no word has no signature
and is never a near-duplicate). Its signature is ``datasketch.MinHash`` over them (``num_perm`` permutations,
``seed``), whose agreement with another signature estimates the two shingle sets' Jaccard similarity.

Two prompts are near-duplicates when that estimate is at least ``threshold``: ``datasketch.MinHashLSH`` (bands
chosen by datasketch for ``threshold``) finds the candidate pairs, and each candidate's estimate is checked
against ``threshold`` (LSH alone lets pairs below it through).
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np
import pyarrow as pa

from .overlap import words

#: the signature file's columns (one per prompts-shard row, same order)
SIGNATURES = pa.schema([("sample_id", pa.string()), ("source_row", pa.int64()), ("signature", pa.list_(pa.uint32()))])


def shingles(texts: Sequence[str], size: int) -> list[bytes]:
    """The distinct ``size``-word windows of the words of ``texts`` (UTF-8, words joined by one space); all the
    words as one shingle when there are fewer than ``size``; ``[]`` without any word."""
    ws: list[str] = []
    for t in texts:
        ws.extend(words(t))
    if not ws:
        return []
    if len(ws) < size:
        return [" ".join(ws).encode()]
    return list({" ".join(ws[i : i + size]).encode() for i in range(len(ws) - size + 1)})


def signatures(shingle_sets: Sequence[list[bytes]], num_perm: int, seed: int) -> list[np.ndarray | None]:
    """One MinHash signature (``num_perm`` uint32 values) per shingle set, None for an empty set."""
    from datasketch import MinHash

    out: list[np.ndarray | None] = [None] * len(shingle_sets)
    todo = [i for i, s in enumerate(shingle_sets) if s]
    if todo:
        hashes = MinHash.bulk([shingle_sets[i] for i in todo], num_perm=num_perm, seed=seed)
        for i, m in zip(todo, hashes):
            out[i] = m.hashvalues.astype(np.uint32)  # datasketch keeps them below 2**32
    return out


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """The two signatures' estimate of the Jaccard similarity: the share of equal values."""
    return float(np.mean(a == b))


class NearDuplicateFinder:
    """The signatures of one shard's prompts in an LSH index; :meth:`check` streams the prompts that come before
    them (earlier datasets, in order) and records, for each prompt of the shard, the first one it nearly duplicates.
    """

    def __init__(self, own: Sequence[np.ndarray | None], *, threshold: float, num_perm: int, seed: int):
        from datasketch import LeanMinHash, MinHashLSH

        self.own, self.threshold, self.seed, self.num_perm = own, threshold, seed, num_perm
        self._lean = LeanMinHash
        self.lsh = MinHashLSH(threshold=threshold, num_perm=num_perm)
        self.indexed = 0
        for i, sig in enumerate(own):
            if sig is not None:
                self.indexed += 1
                self.lsh.insert(i, LeanMinHash(seed=seed, hashvalues=sig), check_duplication=False)
        #: own row index -> (dataset, sample_id, estimated Jaccard) of the first earlier prompt it nearly duplicates
        self.matches: dict[int, tuple[str, str, float]] = {}

    def check(
        self,
        dataset: str,
        rows: Iterable[tuple[str, np.ndarray | None]],
        before: Sequence[int] | None = None,
        positions: Iterable[int] | None = None,
    ) -> int:
        """Look up each earlier prompt ``(sample_id, signature)`` of ``dataset`` (in the stated order); returns
        how many of the shard's prompts it newly matched. Within the shard's own dataset, ``positions`` gives each
        row's place (its source row) and ``before`` each of the shard's prompts' own: a prompt matches only a row
        placed before it."""
        if len(self.matches) == self.indexed:  # nothing (left) to match
            return 0
        found = 0
        places = iter(positions) if positions is not None else None
        for sid, sig in rows:
            place = next(places) if places is not None else None
            if sig is None:
                continue
            for i in self.lsh.query(self._lean(seed=self.seed, hashvalues=sig)):
                if i in self.matches or (before is not None and not place < before[i]):
                    continue
                j = jaccard(self.own[i], sig)
                if j >= self.threshold:
                    self.matches[i] = (dataset, sid, j)
                    found += 1
        return found
