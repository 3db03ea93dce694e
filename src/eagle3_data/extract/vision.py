"""Image rows in extraction: a selection's rows whose prompt holds images are forwarded through the target's vision
tower, so the states stored at every position (the image placeholders' included) are the ones the engine computes.

Where the images come from: the selection's validated file (``results/<dataset>/validated/<shard>.parquet``,
``ExtractSettings.validated_path``; column ``images``: each image's file, SHA-256, size and placeholder positions; ``schemas.TOKENS``). Each file is
read again and checked against its digest, run through the target's own image processor
(:class:`eagle3_data.images.TargetImages`) and its patch count compared with the placeholder positions the row
holds, so a changed image or a cut image is an error, never a wrong state.

How they are forwarded: one image row per forward, the multimodal model's base (``model.model``: vision tower,
merger, language model) with ``pixel_values``, ``image_grid_thw`` and ``mm_token_type_ids`` (Qwen2-VL family:
1 at image placeholders; the model's 3-D rotary positions are computed from them). Text rows of the same
selection keep their batches (packed or padded); in the packed layout an image row is a pack of one sample.
The hooks on the decoder layers and the final norm are the ones text rows use.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq


def is_multimodal(model_path) -> bool:
    """Whether the target folder's ``config.json`` describes a vision-language model (it has a ``vision_config``)."""
    cfg = Path(model_path) / "config.json"
    return cfg.is_file() and "vision_config" in json.loads(cfg.read_text())


def model_class(model_path):
    """The transformers auto class that loads the target: ``AutoModelForImageTextToText`` for a vision-language
    model transformers knows (:func:`is_multimodal`, its ``model_type`` in that class's mapping, no ``auto_map``),
    else ``AutoModelForCausalLM`` (a text model; a target with its own code, e.g. Kimi K2.5's, as its
    ``auto_map`` names it)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    if is_multimodal(model_path):
        cfg = json.loads((Path(model_path) / "config.json").read_text())
        if not cfg.get("auto_map") and cfg.get("model_type") in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
            return transformers.AutoModelForImageTextToText
    return transformers.AutoModelForCausalLM


def selection_images(validated_path, sample_ids: list[str]) -> dict[int, str]:
    """The ``images`` value (JSON text) of each row of a selection that has images: {row index in ``sample_ids``:
    images}, read from the selection's validated file ``validated_path`` (rows matched by ``sample_id``; a file
    written before the column existed has none). ``None`` path: no images. Raises ValueError naming the file
    when a selection row with images is not in it."""
    if validated_path is None or not Path(validated_path).is_file():
        return {}
    pf = pq.ParquetFile(validated_path)
    if "images" not in pf.schema_arrow.names:
        return {}
    table = pf.read(columns=["sample_id", "images"])
    by_id = {s: v for s, v in zip(table.column("sample_id").to_pylist(), table.column("images").to_pylist()) if v}
    return {i: by_id[s] for i, s in enumerate(sample_ids) if s in by_id}


def image_digests(images: str) -> str:
    """The images' SHA-256s of a row's ``images`` value, as one JSON text (what a stored row is reused by)."""
    return json.dumps([im["sha256"] for im in json.loads(images)])


class ImageInputs:
    """The model inputs of image rows, made with the target's own image processor (``preprocessor_config.json``
    of ``model_path``; Qwen2-VL family, :class:`eagle3_data.images.TargetImages`)."""

    def __init__(self, model_path, model=None):
        from ..images import TargetImages

        self.images = TargetImages.load(model_path)
        base = getattr(model, "model", model)
        self.takes_types = base is not None and "mm_token_type_ids" in inspect.signature(base.forward).parameters

    def __call__(self, ids: np.ndarray, images: str, where: str = "") -> dict:
        """``pixel_values`` [P, C*t*p*p] float32, ``image_grid_thw`` [N, 3] int64 and (when the model takes them)
        ``mm_token_type_ids`` [1, T] int64 for a row with token ids ``ids`` [T] and ``images`` (its JSON).

        Raises ValueError naming ``where`` when an image file is gone or changed (``image_missing``) or the
        processor's patch count differs from the row's placeholder positions (a cut or another processor)."""
        import torch

        from ..images import ImageProblem, open_images, parts_of_row

        spans = json.loads(images)
        try:
            pics = open_images(parts_of_row(images))
        except ImageProblem as exc:
            raise ValueError(f"{where}: {exc}") from None
        inputs = self.images.inputs(pics)
        counts = self.images.placeholder_counts(inputs["image_grid_thw"])
        tok = self.images.image_token_id
        for k, (im, n) in enumerate(zip(spans, counts)):
            s = int(im["start"])
            if int(im["length"]) != n or not (ids[s : s + n] == tok).all() or s + n > len(ids):
                raise ValueError(
                    f"{where}: image {k} ({im['url']}) takes {n} positions in the target's processor; the row holds "
                    f"{int(im['length'])} placeholder(s) at {s} (cut by merge.max_len, or tokenized with another "
                    "processor): rerun tokenize"
                )
        found = int((ids == tok).sum())
        if found != sum(counts):
            raise ValueError(f"{where}: {found} image placeholder positions for {len(counts)} image(s) of {counts}")
        out = {"pixel_values": inputs["pixel_values"], "image_grid_thw": inputs["image_grid_thw"]}
        if self.takes_types:
            out["mm_token_type_ids"] = torch.from_numpy((np.asarray(ids) == tok).astype(np.int64))[None]
        return out
