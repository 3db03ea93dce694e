"""A tiny random Qwen2.5-VL target with a real processor, and small images drawn with PIL: the target of
``resources/configs/images.yaml`` (``target.tiny.kind: qwen2.5-vl``, rule tiny_target) and of the image-prompt tests
(:mod:`eagle3_data.images`).

No small vision-language model's weights install offline, so :func:`build_tiny_vlm` makes one from transformers'
``Qwen2_5_VLConfig``: the real Qwen vocabulary and special tokens (:mod:`eagle3_data.qwen_vocabulary`, which
holds ``<|vision_start|>`` 151652, ``<|image_pad|>`` 151655), the published Qwen2.5-VL chat template
(``chat_templates/qwen2.5-vl.jinja`` beside this module), transformers' Qwen2-VL image processor with its default patching (patch 14,
merge 2, temporal 2) and a small pixel range, and random weights: a 2-block vision tower whose merger feeds a
4-layer, 64-wide language model. It runs on the CPU in well under a second per prompt.

transformers' ``Qwen2_5_VLProcessor`` also wants a video processor, which needs torchvision (not installable beside
the CPU torch here); :class:`ImageOnlyProcessor` is the same processor without videos.
"""

from __future__ import annotations

from pathlib import Path

#: the Qwen2.5-VL special tokens the tiny target uses (Qwen's ids)
IMAGE_TOKEN_ID, VIDEO_TOKEN_ID, VISION_START_ID, VISION_END_ID = 151655, 151656, 151652, 151653
#: pixels an image is resized into (the processor keeps its aspect and rounds to 28-pixel steps)
MIN_PIXELS, MAX_PIXELS = 56 * 56, 112 * 112


def image_only_processor_class():
    """transformers' ``Qwen2_5_VLProcessor`` without a video processor (a class made on first use)."""
    from transformers import Qwen2_5_VLProcessor
    from transformers.processing_utils import ProcessorMixin

    class ImageOnlyProcessor(Qwen2_5_VLProcessor):
        """``Qwen2_5_VLProcessor`` for images only: its text and image handling, no video processor."""

        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    return ImageOnlyProcessor


def chat_template_text() -> str:
    """The published Qwen2.5-VL chat template (``chat_templates/qwen2.5-vl.jinja``; source in README.md there)."""
    return (Path(__file__).resolve().parent / "chat_templates" / "qwen2.5-vl.jinja").read_text(encoding="utf-8")


def tokenizer():
    """A transformers tokenizer with Qwen's real vocabulary (:func:`eagle3_data.qwen_vocabulary.qwen3_backend`)
    and the Qwen2.5-VL chat template."""
    from transformers import PreTrainedTokenizerFast

    from .qwen_vocabulary import qwen3_backend

    return PreTrainedTokenizerFast(
        tokenizer_object=qwen3_backend(),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=chat_template_text(),
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 20,
    )


def build_tiny_vlm(path, seed: int = 0) -> Path:
    """Write the tiny Qwen2.5-VL target to ``path`` (``config.json``, ``model.safetensors`` in float32, the
    tokenizer files with the chat template, ``preprocessor_config.json``). Returns ``path``."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    path = Path(path)
    tok = tokenizer()  # Qwen's vocabulary with the Qwen2.5-VL template
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": 151936,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 4096,
            "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
            "tie_word_embeddings": True,
        },
        vision_config={
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": 64,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 56,
            "fullatt_block_indexes": [1],
        },
        image_token_id=IMAGE_TOKEN_ID,
        video_token_id=VIDEO_TOKEN_ID,
        vision_start_token_id=VISION_START_ID,
        vision_end_token_id=VISION_END_ID,
    )
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    model.save_pretrained(path)
    tok.save_pretrained(path)
    Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS).save_pretrained(path)
    return path


def build_tiny_vlm_target(out_dir, settings) -> dict:
    """Rule tiny_target for ``target.tiny.kind: qwen2.5-vl``: :func:`build_tiny_vlm` with ``settings.seed``
    (:class:`~eagle3_data.settings.TinyTargetSettings`), built in a temporary folder beside ``out_dir`` and renamed
    into place (``out_dir`` is absent, the previous build or complete), with ``tiny_target.json`` (the returned
    ``{"kind", "seed", "image_token_id"}``: what marks a folder the build made)."""
    import json
    import shutil
    import tempfile

    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    info = {"kind": "qwen2.5-vl", "seed": settings.seed, "image_token_id": IMAGE_TOKEN_ID}
    try:
        build_tiny_vlm(tmp, seed=settings.seed)
        (tmp / "tiny_target.json").write_text(json.dumps(info, indent=2) + "\n")  # what the config checks look for
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return info


def load_processor(path):
    """The tiny target's processor (:func:`image_only_processor_class`) from its folder ``path``."""
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    tok = AutoTokenizer.from_pretrained(str(path))
    return image_only_processor_class()(
        image_processor=Qwen2VLImageProcessorPil.from_pretrained(str(path)),
        tokenizer=tok,
        chat_template=tok.chat_template,
    )


#: the bundled images: file name -> (size, background, drawing) (:func:`draw_images`)
SHAPES = {
    "red_circle.png": ((80, 60), "white", ("ellipse", (20, 10, 60, 50), "red")),
    "blue_square.png": ((64, 64), "white", ("rectangle", (12, 12, 52, 52), "blue")),
    "green_triangle.png": ((96, 72), "white", ("polygon", [(48, 8), (88, 64), (8, 64)], "green")),
    "yellow_bar.png": ((120, 40), "black", ("rectangle", (10, 12, 110, 28), "yellow")),
}


def draw_images(folder) -> list[Path]:
    """Draw :data:`SHAPES` as PNG files in ``folder`` (the same bytes every time). Returns their paths."""
    from PIL import Image, ImageDraw

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for name, (size, background, (shape, where, fill)) in SHAPES.items():
        im = Image.new("RGB", size, background)
        getattr(ImageDraw.Draw(im), shape)(where, fill=fill)
        im.save(folder / name, format="PNG", optimize=False)
        out.append(folder / name)
    return out
