"""Bytes per token of the states and of each export layout (the plan's arithmetic: :mod:`.build`'s docstring)."""

from __future__ import annotations

from ..extract.model import DFLASH_DRAFT_LAYERS
from ..export.layouts import INPLACE_LAYOUTS

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
TB, TIB = 1e12, float(2**40)


def bytes_per_token(
    hidden_size: int,
    num_aux: int = 3,
    *,
    dtype: str = "bfloat16",
    aux_format: str = "same",
    final: str = "all",
    final_share: float = 1.0,
    ids_bytes: int = 5,
    final_format: str = "same",
) -> dict:
    """Bytes per token of one layout, by part: ``{aux, final, ids, total}`` (floats).

    ``final``: ``all`` (H rows for every token), ``supervised`` (``final_share`` of the rows + a 1-byte
    mask), ``none`` (not stored). ``aux_format`` / ``final_format``: ``same`` (``dtype``) or ``fp8_e4m3`` (1 byte a
    value + a float32 scale per token and layer). ``ids_bytes``: 5 for the extract file (int32 ids + int8 mask),
    16 for SpecForge ``.ckpt`` (int64 + int64), 8 for speculators ``hs_*`` (int64 ids).
    """
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"plan: dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
    b = DTYPE_BYTES[dtype]
    H, A = int(hidden_size), int(num_aux)
    aux = A * H * 1 + 4 * A if aux_format == "fp8_e4m3" else A * H * b
    row = H + 4 if final_format == "fp8_e4m3" else H * b
    if final == "all":
        fin = row
    elif final == "supervised":
        fin = row * float(final_share) + 1
    elif final == "none":
        fin = 0
    else:
        raise ValueError(f"plan: final must be all, supervised or none, got {final!r}")
    return {"aux": float(aux), "final": float(fin), "ids": float(ids_bytes), "total": float(aux + fin + ids_bytes)}


def export_bytes_per_token(
    layout: str,
    hidden_size: int,
    *,
    eagle3_layers: int = 3,
    dflash_layers: int = DFLASH_DRAFT_LAYERS,
    dtype: str = "bfloat16",
) -> dict:
    """Bytes per token of an export ``layout`` (``eagle3_data.export.CONTRACTS``), every row written in ``dtype``:
    ``{aux, final, ids, total}`` (module docstring; the file headers not counted). Raises ValueError for an
    unknown layout."""
    H, A, F = int(hidden_size), int(eagle3_layers), int(dflash_layers)
    if layout in ("specforge", "modelopt"):
        return bytes_per_token(H, A, dtype=dtype, ids_bytes=16)
    if layout in ("specforge_dflash", "specforge_dspark"):
        return bytes_per_token(H, F, dtype=dtype, ids_bytes=16, final="all" if layout == "specforge_dspark" else "none")
    if layout == "speculators":
        return bytes_per_token(H, A, dtype=dtype, ids_bytes=8)
    if layout in INPLACE_LAYOUTS:  # its sample table only (int64 ids and mask): the states are read in place
        return {"aux": 0.0, "final": 0.0, "ids": 16.0, "total": 16.0}
    if layout == "speculators_fp8":  # [T, A+1, H] fp8 + one float32 scale per token
        return {"aux": float(A * H), "final": float(H), "ids": 12.0, "total": float((A + 1) * H + 12)}
    raise ValueError(f"plan: unknown export layout {layout!r}")
