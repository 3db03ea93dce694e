"""Decontamination before generation: prompts that overlap a benchmark the drafter is scored on, and near-duplicate
prompts across datasets, are rejected (named, counted) before anything is paid for them.

- :mod:`.benchmarks` - the benchmark files a config names (HumanEval, MBPP, GSM8K, MATH-500, MT-Bench, SWE-bench,
  generic), read into items (benchmark, item id, prompt texts);
- :mod:`.overlap` - exact, whitespace-normalised and word n-gram overlap (GPT-3's 13-gram rule) with the items;
- :mod:`.near_dup` - MinHash signatures and an LSH index (``datasketch``) for near-duplicates;
- :mod:`.stage` - rules ``minhash`` and ``decontaminate`` (:func:`minhash`, :func:`decontaminate`).
"""

from .benchmarks import FORMATS, BenchmarkError, BenchmarkItem, benchmark_path, read_benchmark  # noqa: F401
from .overlap import Match, OverlapIndex, ngrams, squash, words  # noqa: F401
from .stage import REASONS, STAGE, benchmark_inputs, decontaminate, minhash, prompt_texts  # noqa: F401
