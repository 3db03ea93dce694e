"""Fused elementwise kernels for the extraction forward (``extract.fused: auto | on | off``).

On an H200, one profiled batch of the packed forward of an 8B Llama spent 26.6% of its device time in
elementwise kernels (the RMSNorms' float32 casts, squares, means and multiplies; the MLP's SiLU and product),
which are memory-bound and run one kernel per operation in eager PyTorch (``benchmarks/extract_gpu.py``'s profile
line). Here each decoder layer's RMSNorms and its MLP activation product are replaced, per module instance, by one
``torch.compile``'d function each (shared by every layer: compiled once, shapes dynamic), only when the
replacement reproduces the module's own output on a probe:

- RMSNorm, the formula of transformers' ``LlamaRMSNorm`` (also Qwen2/Qwen3/Mistral/DeepseekV3):
  ``weight * (x.float() * rsqrt(mean(x.float()**2) + eps)).to(x.dtype)``;
- the MLP of ``LlamaMLP`` (``down_proj(act_fn(gate_proj(x)) * up_proj(x))``) whose ``act_fn`` is SiLU: the product
  ``silu(gate) * up`` in one kernel (the three matmuls stay as they are; the probe compares the product).

A module whose forward differs (another norm formula, another activation, a gated MoE block) is left alone. The
fused kernels compute the same formulas in another order of floating-point operations, so the states may differ
from the eager ones by the rounding of the stored dtype; the probe accepts at most one unit in the last place of
the output dtype (bfloat16: 2**-8 relative). The attention path is unchanged.
"""

from __future__ import annotations

import logging
import types

log = logging.getLogger("eagle3_data.extract")

FUSED_MODES = ("auto", "on", "off")
_compiled: dict = {}


def _rms(x, weight, eps: float):
    import torch

    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def _silu_mul(gate, up):
    import torch

    return torch.nn.functional.silu(gate) * up


def _fn(name: str):
    import torch

    if name not in _compiled:
        _compiled[name] = torch.compile(
            {"rms": _rms, "silu_mul": _silu_mul}[name], dynamic=True, options={"emulate_precision_casts": True}
        )
    return _compiled[name]


def _rms_forward(self, hidden_states):
    return _fn("rms")(hidden_states, self.weight, self.variance_epsilon)


def _mlp_forward(self, x):
    return self.down_proj(_fn("silu_mul")(self.gate_proj(x), self.up_proj(x)))


def _close(a, b) -> bool:
    """``a`` equals ``b`` within one unit in the last place of their dtype (relative to each element)."""
    import torch

    eps = torch.finfo(b.dtype).eps
    diff = (a.float() - b.float()).abs()
    return bool((diff <= eps * b.float().abs() + torch.finfo(b.dtype).tiny).all())


def fuse_elementwise(decoder, mode: str = "auto") -> dict:
    """Fuse the RMSNorms and MLP activation products of ``decoder`` (a transformers decoder with ``layers`` and
    ``norm``) where the fused function reproduces each module's output on a probe (module docstring).

    ``mode``: ``"auto"`` (fuse on CUDA only), ``"on"`` (fuse on any device; on a CPU ``torch.compile`` needs a C++
    compiler), ``"off"``. Returns ``{"norms": n, "mlps": n, "skipped": [reasons]}``. Raises ValueError for an
    unknown mode. A compile failure leaves every module as it was and is reported in ``skipped``.
    """
    import torch

    if mode not in FUSED_MODES:
        raise ValueError(f"extract.fused must be one of {FUSED_MODES}, got {mode!r}")
    out: dict = {"norms": 0, "mlps": 0, "skipped": []}
    weight = decoder.norm.weight
    if mode == "off" or (mode == "auto" and weight.device.type != "cuda"):
        out["skipped"].append(f"fused: {mode} on {weight.device.type}")
        return out
    norms, mlps = [], []
    for layer in decoder.layers:
        for name in ("input_layernorm", "post_attention_layernorm"):
            m = getattr(layer, name, None)
            if m is not None and hasattr(m, "variance_epsilon") and getattr(m, "weight", None) is not None:
                norms.append(m)
        mlp = getattr(layer, "mlp", None)
        if mlp is not None and all(hasattr(mlp, a) for a in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            mlps.append(mlp)
    norms.append(decoder.norm)
    g = torch.Generator(device="cpu").manual_seed(0)
    probe = (torch.randn(3, 5, weight.shape[-1], generator=g) * 4).to(weight.device, weight.dtype)
    try:
        with torch.inference_mode():
            for m in norms:
                if _close(_rms_forward(m, probe), m(probe)):
                    m.forward = types.MethodType(_rms_forward, m)
                    out["norms"] += 1
                else:
                    out["skipped"].append(f"{type(m).__name__}: another formula")
            gate = (torch.randn(3, 5, 64, generator=g) * 4).to(weight.device, weight.dtype)
            up = torch.randn(3, 5, 64, generator=g).to(weight.device, weight.dtype)
            for m in mlps:  # the product within an ulp, and the whole block the same formula (its matmuls sum
                # the product's rounding: relative L2 error, not per element)
                whole = _mlp_forward(m, probe).float()
                ref = m(probe).float()
                same = float((whole - ref).norm() / ref.norm().clamp_min(1e-30)) <= torch.finfo(weight.dtype).eps
                if same and _close(_fn("silu_mul")(gate, up), m.act_fn(gate) * up):
                    m.forward = types.MethodType(_mlp_forward, m)
                    out["mlps"] += 1
                else:
                    out["skipped"].append(f"{type(m).__name__}: another activation")
    except Exception as exc:  # noqa: BLE001 - an unfusable model runs as it is
        for m in norms + mlps:
            if _ours(m):
                del m.__dict__["forward"]
        out.update(norms=0, mlps=0)
        out["skipped"].append(f"compile failed: {type(exc).__name__}: {str(exc)[:200]}")
    log.info(
        "fused elementwise kernels: %d norms, %d MLPs%s",
        out["norms"],
        out["mlps"],
        f" (skipped: {sorted(set(out['skipped']))[:4]})" if out["skipped"] else "",
    )
    return out


def _ours(m) -> bool:
    f = m.__dict__.get("forward")
    return getattr(f, "__func__", None) in (_rms_forward, _mlp_forward)


def unfuse(decoder) -> None:
    """Give the modules :func:`fuse_elementwise` fused their class's own forward back (other instance-level
    forwards are left as they are)."""
    for m in decoder.modules():
        if _ours(m):
            del m.__dict__["forward"]
