"""The tokenizer a target's server tokenizes with: :func:`as_shipped` checks a loaded tokenizer against the
``tokenizer.json`` its directory ships, and loads that file as it is when they encode differently."""

from __future__ import annotations

from .formats import TemplateError


#: text whose encoding tells a tokenizer pipeline that keeps spaces, newlines, digits and CJK from one that does not
PROBE_TEXT = "Hello world, 2 + 2 = 4.\n\n  indented line\t東京 café"


#: tokenizer classes that load tokenizer.json as it is (nothing to check)
AS_FILE_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")


def as_shipped(tok, path: str):
    """``tok``, or the directory's ``tokenizer.json`` loaded as it is when ``tok`` encodes differently from it.

    A directory declaring a class whose transformers implementation rebuilds the pipeline (DeepSeek-R1/V3 declare
    ``LlamaTokenizerFast`` over a byte-level BPE) loads under transformers 5.0-5.21 with a Llama pre-tokenizer
    that drops every space, so every completion fails ``round_trip``. The shipped ``tokenizer.json`` is what the
    target's server tokenizes with: when the loaded tokenizer's ids for a probe text differ from that file's, the
    file is loaded as it is (``PreTrainedTokenizerFast``, chat template and special tokens from the directory's
    config). Raises :class:`TemplateError` when even that differs."""
    import logging
    import os

    file = os.path.join(path, "tokenizer.json")
    backend = getattr(tok, "backend_tokenizer", None) if getattr(tok, "is_fast", False) else None
    if backend is None or not os.path.isfile(file) or type(tok).__name__ in AS_FILE_CLASSES:
        return tok  # the generic classes take tokenizer.json as it is
    from tokenizers import Tokenizer

    want = Tokenizer.from_file(file).encode(PROBE_TEXT, add_special_tokens=False).ids
    if backend.encode(PROBE_TEXT, add_special_tokens=False).ids == want:
        return tok
    from transformers import PreTrainedTokenizerFast

    logging.getLogger("eagle3_data.templates").warning(
        "%s: transformers loads this tokenizer as %s, which encodes differently from the tokenizer.json it ships "
        "(e.g. spaces dropped); using tokenizer.json as it is",
        path,
        type(tok).__name__,
    )
    fixed = PreTrainedTokenizerFast.from_pretrained(path)
    if fixed.backend_tokenizer.encode(PROBE_TEXT, add_special_tokens=False).ids != want:
        raise TemplateError(f"{path}: the tokenizer loads with another encoding than its tokenizer.json")
    return fixed
