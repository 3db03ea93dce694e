"""Image-prompt sources (multimodal targets: :mod:`eagle3_data.images`).

* ``llava`` — LLaVA-Instruct (liuhaotian/LLaVA-Instruct-150K, ``llava_v1_5_mix665k.json``), ShareGPT4V
  (Lin-Chen/ShareGPT4V) and ALLaVA (FreedomIntelligence/ALLaVA-4V) records: ``{id, image, conversations: [{from,
  value}]}``, ``image`` a path (or a list of paths) relative to the dataset's image folder, one ``<image>`` marker
  per image in the human turns (``"<image>\\nWhat is in the picture?"``). Roles as ``sharegpt``. Each marker becomes
  that image's content part, in place (the newline that follows a marker is the marker's, as in LLaVA's own
  preprocessing); a record with one image and no marker gets the image before its first user text (LLaVA's
  convention); a record without ``image`` is a text prompt.

Images are read from ``options.image_dir`` (relative to the working directory), each decoded once: a missing or
unreadable file, or markers that do not match the images in number, reject the row (``image_missing``,
``image_unreadable``, ``image_marker_mismatch``). ``openai_messages`` takes ``image_url`` parts the same way when
its ``image_dir`` option is set (their ``url`` a path relative to it).
"""

from __future__ import annotations

from typing import Any

from .base import RowReject, Sample, resolve_image
from .sharegpt import ShareGPT


class LLaVA(ShareGPT):
    name = "llava"
    required_key = "conversations"
    expected = "a LLaVA / ShareGPT4V / ALLaVA record with `image` and a `conversations` list of {from, value}"
    option_defaults: dict[str, Any] = {
        **ShareGPT.option_defaults,
        "image_field": "image",
        "image_dir": None,  # the folder the image paths are relative to
        "marker": "<image>",
        "merge_consecutive": False,  # a marker's place is in its own turn
    }

    def convert(self, record: dict) -> Sample:
        sample = super().convert(record)
        names = record.get(self.options["image_field"])
        names = [] if names in (None, "") else [names] if isinstance(names, str) else names
        sid = sample.sample_id
        if not isinstance(names, list):
            raise RowReject("image_missing", f"`{self.options['image_field']}` is a {type(names).__name__}", sid)
        marker = self.options["marker"]
        users = [m for m in sample.messages if m["role"] == "user"]
        markers = sum(m["content"].count(marker) for m in users)
        if markers == 0 and len(names) == 1:
            users[0]["content"] = marker + "\n" + users[0]["content"]
            markers = 1
        if markers != len(names):
            raise RowReject("image_marker_mismatch", f"{markers} `{marker}` marker(s) for {len(names)} image(s)", sid)
        parts = iter([resolve_image(n, self.options["image_dir"], sid) for n in names])
        for m in sample.messages:
            if m["role"] == "user" and marker in m["content"]:
                m["content"] = _split(m["content"], marker, parts)
        for m in sample.messages:  # markers outside user turns would leave an image unplaced
            if m["role"] != "user" and isinstance(m["content"], str) and marker in m["content"]:
                raise RowReject("image_marker_mismatch", f"a `{marker}` marker in a {m['role']} turn", sid)
        return sample


def _split(text: str, marker: str, parts) -> list[dict]:
    """``text`` as content parts: each ``marker`` (and the newline right after it) replaced by the next image part
    of ``parts``; empty text parts left out."""
    out: list[dict] = []
    pieces = text.split(marker)
    for k, piece in enumerate(pieces):
        if k:
            out.append(next(parts))
            piece = piece[1:] if piece.startswith("\n") else piece
        if piece:
            out.append({"type": "text", "text": piece})
    return out
