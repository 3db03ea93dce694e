"""Image prompts for multimodal targets: the image parts of a prompt's messages, and the target's image processor.

An image in a prompt is an OpenAI ``image_url`` content part (the form OpenRouter, vLLM and SGLang take). In the
build's files it names its file as the dataset's image folder (``datasets.<name>.source.options.image_dir``) joined
with the record's name for it (relative to the working directory, as ``source.path`` is, so every later stage finds
it), and carries the file's digest and size, so that a key can depend on the image's bytes rather than on where the
folder is (:func:`image_key`)::

    {"type": "image_url", "image_url": {"url": "resources/samples/images/red_circle.png"},
     "image": {"sha256": "<64 hex digits>", "width": 80, "height": 60}}

:func:`request_content` turns such a part into what an API takes: the same part with a ``data:`` URL and without
the ``image`` key.

The target's processor decides how many positions an image takes. For the Qwen2-VL family (Qwen2-VL, Qwen2.5-VL,
Qwen3-VL: ``preprocessor_config.json`` with ``patch_size``, ``merge_size``, ``temporal_patch_size``) the chat
template writes one ``<|image_pad|>`` per image and the processor repeats it ``t * h * w / merge_size**2`` times,
``(t, h, w)`` being the image's patch grid (transformers ``Qwen2_5_VLProcessor.replace_image_token``; vLLM's
``Qwen2VLMultiModalProcessor`` does the same). :class:`TargetImages` computes it with the target's own image
processor and expands rendered ids with it (:meth:`TargetImages.expand`).
"""

from __future__ import annotations

import base64
import hashlib
import json
import mimetypes
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: the reject reasons of image prompts (stage normalize), with what each means
IMAGE_REJECTS = {
    "image_missing": "an image the record names is not in the dataset's image folder "
    "(datasets.<name>.source.options.image_dir), or its file changed since normalize",
    "image_unreadable": "an image file that PIL cannot decode (truncated, not an image, or an unknown format)",
    "image_marker_mismatch": "the record's `<image>` markers and its images differ in number",
}


class ImageProblem(ValueError):
    """An image of a record cannot be used: ``reason`` is a key of :data:`IMAGE_REJECTS`."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


def image_part(name: str, image_dir) -> dict:
    """The content part of image ``name`` (a path relative to ``image_dir``; its ``url``: the two joined): its file
    decoded once by PIL (whole, not only its header), its SHA-256 and size. Raises :class:`ImageProblem`
    (``image_missing``: no such file, or a path leaving ``image_dir``; ``image_unreadable``: PIL cannot decode
    it)."""
    from PIL import Image, UnidentifiedImageError

    root = Path(image_dir).resolve()
    path = (root / name).resolve()
    if root not in path.parents or not path.is_file():
        raise ImageProblem("image_missing", f"{name!r} is not a file in {image_dir}")
    data = path.read_bytes()
    try:
        with Image.open(path) as im:
            im.load()
            width, height = im.size
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
        raise ImageProblem("image_unreadable", f"{path}: {exc}") from None
    return {
        "type": "image_url",
        "image_url": {"url": str(Path(image_dir) / name)},
        "image": {"sha256": hashlib.sha256(data).hexdigest(), "width": width, "height": height},
    }


def is_image(part: Any) -> bool:
    """Whether a content part is an image part."""
    return isinstance(part, dict) and part.get("type") == "image_url"


def content_text(content: Any) -> str:
    """The text of a message ``content``: itself when a string, else its text parts joined (image parts left out)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")


def image_parts(messages: list[dict]) -> list[dict]:
    """The image parts of ``messages``, in order."""
    return [p for m in messages if isinstance(m.get("content"), list) for p in m["content"] if is_image(p)]


def image_key(messages: list[dict]) -> str:
    """The images of ``messages`` as one JSON text of their digests, in order ("" for none): what a request key or
    a prompt key adds for them."""
    digests = [p["image"]["sha256"] for p in image_parts(messages)]
    return json.dumps(digests) if digests else ""


def key_messages(messages: list) -> list:
    """``messages`` as a request key or a reply index reads them: an image part without its ``url`` (its
    ``image`` digest stays), so moving the image folder keeps the key; messages without images unchanged."""
    out = []
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and any(is_image(p) for p in content):
            m = {
                **m,
                "content": [{k: v for k, v in p.items() if k != "image_url"} if is_image(p) else p for p in content],
            }
        out.append(m)
    return out


def request_messages(messages: list) -> list:
    """``messages`` as an API takes them: each content through :func:`request_content` (a data URL per image).
    Raises :class:`ImageProblem`."""
    if not any(isinstance(m.get("content"), list) for m in messages if isinstance(m, dict)):
        return messages
    return [
        {**m, "content": request_content(m["content"])} if isinstance(m.get("content"), list) else m for m in messages
    ]


def data_url(path, data: bytes | None = None) -> str:
    """``data:<mime>;base64,<bytes>`` of the file ``path`` (its bytes ``data`` when already read; the MIME type from
    its name, PNG when unknown)."""
    mime = mimetypes.guess_type(str(path))[0] or "image/png"
    data = Path(path).read_bytes() if data is None else data
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"


def image_bytes(part: dict) -> bytes:
    """The bytes of an image part's file, read once and checked against its digest. Raises :class:`ImageProblem`
    (``image_missing``) when the file is gone or holds other bytes."""
    path = Path(part["image_url"]["url"])
    data = path.read_bytes() if path.is_file() else None
    if data is None or hashlib.sha256(data).hexdigest() != part["image"]["sha256"]:
        raise ImageProblem("image_missing", f"{path} is gone or changed since normalize")
    return data


def row_images(parts: list[dict], spans: list[tuple[int, int]]) -> str:
    """The TOKENS/VALIDATED ``images`` value of a row: JSON list of each image part's file (``url``), digest and
    size with its placeholder positions ``start`` (0-based index in ``input_ids``) and ``length``."""
    return json.dumps(
        [{"url": p["image_url"]["url"], **p["image"], "start": s, "length": n} for p, (s, n) in zip(parts, spans)]
    )


def span_problem(ids, mask, images: str) -> str | None:
    """Why a row's ``images`` spans do not fit its ids and loss mask (None when they do): each image's positions
    ``[start, start + length)`` inside the row, one id throughout, loss mask 0, before the first supervised
    position, in order and apart. ``ids``, ``mask``: the row's ``input_ids`` and ``loss_mask`` (1-D arrays)."""
    import numpy as np

    ids, mask = np.asarray(ids), np.asarray(mask)
    sup = np.flatnonzero(mask)
    first_sup = int(sup[0]) if len(sup) else len(ids)
    end = 0
    for k, im in enumerate(json.loads(images)):
        s, n = int(im["start"]), int(im["length"])
        if n < 1 or s < end or s + n > len(ids):
            return f"image {k}: positions [{s}, {s + n}) outside the row of {len(ids)} or overlapping image {k - 1}"
        if (ids[s : s + n] != ids[s]).any():
            return f"image {k}: positions [{s}, {s + n}) hold other ids than its placeholder {int(ids[s])}"
        if s + n > first_sup:
            return f"image {k}: positions [{s}, {s + n}) reach the first supervised position {first_sup}"
        end = s + n
    return None


def parts_of_row(images: str) -> list[dict]:
    """The image parts (:func:`image_part`'s form) of a row's ``images`` value."""
    return [
        {
            "type": "image_url",
            "image_url": {"url": im["url"]},
            "image": {"sha256": im["sha256"], "width": im["width"], "height": im["height"]},
        }
        for im in json.loads(images)
    ]


def open_images(parts: list[dict]) -> list:
    """The PIL images (RGB) of image parts, each file read once and checked (:func:`image_bytes`)."""
    import io

    from PIL import Image

    out = []
    for p in parts:
        with Image.open(io.BytesIO(image_bytes(p))) as im:
            out.append(im.convert("RGB"))
    return out


def request_content(content: Any) -> Any:
    """``content`` as an API takes it: image parts with a ``data:`` URL of their file and without the build's
    ``image`` key; text parts and strings unchanged. Raises :class:`ImageProblem` (``image_missing``) when a file
    is gone, or holds other bytes than its digest says."""
    if not isinstance(content, list):
        return content
    out = []
    for p in content:
        if not is_image(p):
            out.append(p)
            continue
        url = p["image_url"]["url"]
        out.append({"type": "image_url", "image_url": {"url": data_url(url, image_bytes(p))}})
    return out


@dataclass
class TargetImages:
    """The image side of a multimodal target: its image processor (``preprocessor_config.json`` of the target's
    folder) and the id of its image placeholder token.

    Qwen2-VL family only (``image_processor_type`` ``Qwen2VLImageProcessor``); ValueError names another. The
    processor runs on PIL (transformers ``Qwen2VLImageProcessorPil``), with the target's own settings."""

    processor: Any
    image_token_id: int

    @classmethod
    def load(cls, target_dir, image_token_id: int | None = None) -> "TargetImages":
        """The target folder's image processor; ``image_token_id`` from its ``config.json`` when not given."""
        from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

        target_dir = Path(target_dir)
        cfg_path = target_dir / "preprocessor_config.json"
        if not cfg_path.is_file():
            raise ValueError(f"{target_dir}: no preprocessor_config.json: not a multimodal target")
        cfg = json.loads(cfg_path.read_text())
        kind = str(cfg.get("image_processor_type", ""))
        if not kind.startswith("Qwen2VLImageProcessor"):
            raise ValueError(f"{cfg_path}: image_processor_type {kind!r}: only the Qwen2-VL family is supported")
        if image_token_id is None:
            image_token_id = int(json.loads((target_dir / "config.json").read_text())["image_token_id"])
        return cls(Qwen2VLImageProcessorPil.from_pretrained(str(target_dir)), int(image_token_id))

    def inputs(self, images: list) -> dict:
        """The model's image inputs for ``images`` (PIL images, in prompt order): ``pixel_values`` [P, C*t*p*p]
        float32 and ``image_grid_thw`` [N, 3] int64."""
        return dict(self.processor(images=images, return_tensors="pt"))

    def placeholder_counts(self, grid_thw) -> list[int]:
        """Positions each image takes: ``t * h * w // merge_size**2`` per row of ``grid_thw`` [N, 3]."""
        merge = int(self.processor.merge_size) ** 2
        return [int(t) * int(h) * int(w) // merge for t, h, w in grid_thw.tolist()]

    def count_for_size(self, width: int, height: int) -> int:
        """Positions an image of ``width`` x ``height`` pixels takes, from its size alone (no pixels read): the
        processor's resize (transformers ``smart_resize``: multiples of ``patch_size * merge_size`` within its
        pixel bounds) in patches, over ``merge_size**2``; the same as :meth:`placeholder_counts` of its inputs."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        p = self.processor
        patch, merge = int(p.patch_size), int(p.merge_size)
        h, w = smart_resize(
            int(height),
            int(width),
            factor=patch * merge,
            min_pixels=p.size.shortest_edge,
            max_pixels=p.size.longest_edge,
        )
        return (h // patch) * (w // patch) // merge**2

    def expand_spans(self, ids: list[int], counts: list[int]) -> tuple[list[int], list[tuple[int, int]]]:
        """:meth:`expand` and each image's ``(start, length)`` in the expanded ids."""
        out = self.expand(ids, counts)
        spans, at = [], 0
        for n in counts:
            at = out.index(self.image_token_id, at)
            spans.append((at, n))
            at += n
        return out, spans

    def expand(self, ids: list[int], counts: list[int]) -> list[int]:
        """``ids`` (a rendered prompt: one image token per image) with the k-th image token repeated ``counts[k]``
        times. Raises ValueError when the image tokens and ``counts`` differ in number."""
        found = sum(1 for i in ids if i == self.image_token_id)
        if found != len(counts):
            raise ValueError(f"the ids hold {found} image token(s) for {len(counts)} image(s)")
        out, k = [], 0
        for i in ids:
            if i == self.image_token_id:
                out.extend([i] * counts[k])
                k += 1
            else:
                out.append(i)
        return out
