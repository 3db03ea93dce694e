"""The FLOP count of a Llama-style decoder's forward pass, shared by the extraction benchmarks
(``benchmarks/extract_gpu.py`` counts its MFU with it, ``benchmarks/extract.py`` its CPU floor). numpy only: the
GPU machine's guarded runs import it."""

from __future__ import annotations

import numpy as np


def decoder_params(cfg: dict) -> int:
    """Parameters of the decoder layers + final norm (no embedding, no lm_head)."""
    d, f, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    hd = cfg.get("head_dim") or d // cfg["num_attention_heads"]
    q = d * cfg["num_attention_heads"] * hd
    kv = 2 * d * cfg["num_key_value_heads"] * hd
    o = cfg["num_attention_heads"] * hd * d
    mlp = 3 * d * f
    return L * (q + kv + o + mlp + 2 * d) + d


def useful_flops(cfg: dict, lengths) -> float:
    """``2 x decoder parameters x tokens`` + causal attention ``2 x layers x hidden size x sum n^2`` over the
    sequences of ``lengths``."""
    P, L, d = decoder_params(cfg), cfg["num_hidden_layers"], cfg["hidden_size"]
    n = np.asarray(lengths, dtype=np.float64)
    return float(2 * P * n.sum() + 2 * L * d * (n**2).sum())
