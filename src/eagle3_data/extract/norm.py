"""The target's final RMSNorm, recomputed from the states before it (``extract.final_norm: both``).

One extraction stores the final state BEFORE the final norm (what speculators and vLLM read: they apply the norm
themselves) with the norm's weight and epsilon, and derives the state AFTER it (what SpecForge and
Model-Optimizer read: they apply the ``lm_head`` directly) when a layout asks for it. The norm is elementwise
after one mean per row, so the derivation needs the exact formula of the target's norm class. The formulas in
use (transformers 5.x):

==================  ===========================================================================  ====================
formula             output, ``x`` the input in the compute dtype ``d``, ``r = rsqrt(mean(x.float()**2) + eps)``  classes
==================  ===========================================================================  ====================
``llama``           ``w * (x.float() * r).to(d)``                                                LlamaRMSNorm, Qwen3RMSNorm, MistralRMSNorm, DeepseekV3RMSNorm (Kimi K2/K2.5), Glm4MoeRMSNorm
``weight_in_fp32``  ``(w * (x.float() * r)).to(d)``                                              GptOssRMSNorm, Olmo2RMSNorm
``gemma``           ``((x.float() * r) * (1 + w.float())).to(d)``                                GemmaRMSNorm, Gemma3RMSNorm
==================  ===========================================================================  ====================

Computed here in float32 with the weight as float32 and one rounding to the stored dtype at the end (for
``llama`` also after the normalisation): a product of two bfloat16 (or float16) numbers is exact in float32, so
this equals the model's own arithmetic, whatever the weight's dtype.

Which formula a target uses is measured, not looked up: on the first batch of every extract job that forwards,
:func:`check_formulas` compares each formula applied to the norm's input with the norm's own output (a hook on
it) and :func:`pick_formula` takes the one that matches. A formula matches when every element is within one unit
in the last place (ULP) of the stored dtype of the model's output (bit-exact on CPU; one ULP allows another
reduction order of the mean, e.g. a fused GPU kernel), and the best match is the one with the most bit-exact
elements. When none matches (another norm: LayerNorm, a custom class), the file stores the post-norm rows too.
"""

from __future__ import annotations

#: the RMSNorm formulas :func:`apply_norm` knows, in the order ties are broken
NORM_FORMULAS = ("llama", "weight_in_fp32", "gemma")
#: the largest difference, in units in the last place of the stored dtype, of a matching formula
MAX_ULP = 1


def apply_norm(x, weight, eps: float, formula: str, dtype=None):
    """The final norm's output for rows ``x`` [..., H] (any float dtype: the compute dtype's values) with
    ``weight`` [H] (any float dtype), in ``dtype`` (default ``x.dtype``). ``formula``: one of
    :data:`NORM_FORMULAS` (module docstring). Raises ValueError for another formula."""
    import torch

    d = dtype or x.dtype
    xf = x.float()
    h = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    w = weight.float().to(h.device)
    if formula == "llama":
        return (w * h.to(d).float()).to(d)
    if formula == "weight_in_fp32":
        return (w * h).to(d)
    if formula == "gemma":
        return (h * (1.0 + w)).to(d)
    raise ValueError(f"unknown final-norm formula {formula!r}; known: {NORM_FORMULAS}")


def ulp_distance(a, b):
    """Elementwise distance of two tensors of one float dtype in units in the last place (int64 tensor): the
    difference of their bit patterns as sign-ordered integers (+0 and -0 are 0 apart; NaNs are not handled)."""
    import torch

    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    mag = (1 << (8 * a.element_size() - 1)) - 1

    def ordered(t):
        i = t.contiguous().view(bits).long()
        return torch.where(i < 0, -(i & mag), i)

    return (ordered(a) - ordered(b)).abs()


def check_formulas(pre, post, weight, eps: float, dtype, chunk_rows: int = 4096) -> dict:
    """Compare every formula of :data:`NORM_FORMULAS` applied to ``pre`` (the norm's input rows [..., H]) with
    ``post`` (the norm's own output for them), both cast to the stored ``dtype``, ``chunk_rows`` rows at a time
    (a few float32 copies of one chunk at once, on the rows' device). Returns ``{formula: {max_ulp,
    exact_share}}``: the largest difference in ULPs of ``dtype`` and the share of bit-exact elements."""
    pre = pre.reshape(-1, pre.shape[-1])
    post = post.reshape(-1, post.shape[-1])
    n = pre.shape[0] * pre.shape[1]
    worst, exact = dict.fromkeys(NORM_FORMULAS, 0), dict.fromkeys(NORM_FORMULAS, 0)
    for s in range(0, pre.shape[0], chunk_rows):
        x, want = pre[s : s + chunk_rows].to(dtype), post[s : s + chunk_rows].to(dtype)
        for f in NORM_FORMULAS:
            d = ulp_distance(apply_norm(x, weight, eps, f, dtype).to(want.device), want)
            worst[f] = max(worst[f], int(d.max()))
            exact[f] += int((d == 0).sum())
            del d
    return {f: {"max_ulp": worst[f], "exact_share": exact[f] / n if n else 1.0} for f in NORM_FORMULAS}


def pick_formula(results: dict) -> str:
    """The formula of :func:`check_formulas`' ``results`` within :data:`MAX_ULP` everywhere with the largest share
    of bit-exact elements (ties: :data:`NORM_FORMULAS` order), or ``"none"``."""
    ok = [f for f in NORM_FORMULAS if f in results and results[f]["max_ulp"] <= MAX_ULP]
    if not ok:
        return "none"
    return max(ok, key=lambda f: (results[f]["exact_share"], -NORM_FORMULAS.index(f)))


def norm_params(norm_module) -> tuple:
    """``(weight [H] float32 on the CPU, eps)`` of a final-norm module (``weight`` and ``variance_epsilon`` or
    ``eps``); ``(None, None)`` when it has neither (then no formula can match)."""
    w = getattr(norm_module, "weight", None)
    eps = getattr(norm_module, "variance_epsilon", None)
    if eps is None:
        eps = getattr(norm_module, "eps", None)
    if w is None or eps is None:
        return None, None
    return w.detach().float().cpu(), float(eps)
