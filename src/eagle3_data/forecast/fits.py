"""What the pilot's replies tell: the latency fit, the completion-length model and its expected longest, quantiles."""

from __future__ import annotations


def latency_fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares ``latency_s = a + b * completion_tokens`` over (completion_tokens, latency_s) points;
    ``(mean latency, 0.0)`` with fewer than two distinct lengths or a negative slope. Returns (a seconds,
    b seconds per token)."""
    if not points:
        return 0.0, 0.0
    n = len(points)
    mx = sum(c for c, _ in points) / n
    my = sum(t for _, t in points) / n
    sxx = sum((c - mx) ** 2 for c, _ in points)
    if sxx <= 0:
        return my, 0.0
    b = sum((c - mx) * (t - my) for c, t in points) / sxx
    if b < 0:
        return my, 0.0
    return my - b * mx, b


def expected_longest(lengths: list[int], n: float, cap: int | None = None) -> float:
    """Expected longest of ``n`` completion lengths (tokens) drawn like the pilot's ``lengths``: a lognormal fitted
    to them (mean and sample standard deviation of the log lengths), at its ``n / (n + 1)`` quantile (the usual
    approximation of the expected maximum of ``n`` draws; E. J. Gumbel, *Statistics of Extremes*, 1958), capped at
    ``cap`` (``generation.max_tokens``) and never below the pilot's own longest. With fewer than two positive
    lengths: the pilot's longest. Long reasoning replies are rare, so a pilot of a few samples rarely sees the
    longest of thousands; the generation's tail is that longest request finishing after the others."""
    import math
    from statistics import NormalDist, fmean, stdev

    longest = float(max(lengths, default=0))
    logs = [math.log(x) for x in lengths if x > 0]
    if len(logs) < 2 or n <= 1:
        return longest
    q = math.exp(fmean(logs) + stdev(logs) * NormalDist().inv_cdf(n / (n + 1.0)))
    return max(longest, min(q, float(cap)) if cap else q)


def length_model(lengths: list[int], cap: int | None) -> dict:
    """The completion-length model the simulation draws from: a lognormal fitted to the pilot's lengths (``mu``,
    ``sigma`` of their logs; ``sigma`` 0 with fewer than two positive lengths), clipped to ``[1, cap]`` tokens
    (``cap``: ``generation.max_tokens``, None: unclipped). No lengths at all: ``mu`` = -inf (every reply 1 token)."""
    import math
    from statistics import fmean, stdev

    logs = [math.log(x) for x in lengths if x > 0]
    return {
        "mu": fmean(logs) if logs else float("-inf"),
        "sigma": stdev(logs) if len(logs) >= 2 else 0.0,
        "cap": int(cap) if cap else None,
    }


def quantile(xs: list[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` (linear between order statistics, as numpy's default)."""
    s = sorted(xs)
    if not s:
        return 0.0
    k = (len(s) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)
