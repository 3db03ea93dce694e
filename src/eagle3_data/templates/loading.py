"""Target tokenizer loading: :func:`load_target_tokens` / :func:`target_tokens` (from the config ``target``
slice), and the check that a tokenizer encodes as its shipped ``tokenizer.json`` does.
"""

from __future__ import annotations

from .formats import KIMI_TOOL_TOKENS, TemplateError, completion_format
from .target import TargetTokens


def load_target_tokens(path: str, template: str, *, trust_remote_code: bool = False,
                       chat_template_kwargs: dict | None = None, lazy: bool = False) -> TargetTokens:
    """Load the target tokenizer from a local directory and bind it to a completion format (family ``template``;
    ``auto``: the one :func:`eagle3_data.templates.auto.detect_family` finds from its chat template).

    ``trust_remote_code`` lets tokenizers that ship their own code load (Kimi's tiktoken-based
    ``tokenization_kimi.py``); never set implicitly. The loaded tokenizer comes from the local cache of
    :mod:`eagle3_data.tokenizer_cache` when the directory's files were loaded before (same hashes, same library
    versions). ``lazy``: when a job already cached the tokenizer's facts (its length, its ids of the format's
    special tokens, :func:`eagle3_data.tokenizer_cache.tokenizer_facts`), the :class:`TargetTokens` wraps a
    :class:`~eagle3_data.tokenizer_cache.LazyTokenizer` that loads the tokenizer only when it must encode,
    decode or render (a validate job that only checks ids does not); the ids and answers are the same. Raises
    :class:`TemplateError` if the directory has no loadable
    tokenizer (the message says when ``target.trust_remote_code: true`` is needed) or no chat template.
    """
    from transformers import AutoTokenizer

    from ..tokenizer_cache import LazyTokenizer, cached_facts, load_tokenizer, tokenizer_facts

    fmt = completion_format(template) if template != "auto" else None

    def load():
        try:
            tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        except Exception as exc:
            hint = ""
            if not trust_remote_code and ("trust_remote_code" in str(exc) or "custom code" in str(exc)):
                hint = " (this tokenizer ships its own code: set target.trust_remote_code: true)"
            raise TemplateError(f"{path}: cannot load the target tokenizer: {exc}{hint}") from exc
        return _as_shipped(tok, path)

    facts = None
    if fmt is not None:
        names = format_token_names(fmt)
        facts = lambda t: tokenizer_facts(t, names)  # noqa: E731

    def full():
        return load_tokenizer(path, template, trust_remote_code, load, facts)  # once per machine (tokenizer_cache)

    known = cached_facts(path, template, trust_remote_code) if lazy and fmt is not None else None
    tok = LazyTokenizer(known, full) if known is not None else full()
    if not getattr(tok, "chat_template", None):
        raise TemplateError(f"{path}: the target tokenizer has no chat template")
    if fmt is None:  # template: auto (the config check resolves it before any job; here for direct callers)
        from .auto import detect_family

        fmt = completion_format(detect_family(tok, chat_template_kwargs)["family"])
    return TargetTokens(tok, fmt, chat_template_kwargs)


def format_token_names(fmt) -> list[str]:
    """Every special-token name :class:`TargetTokens` and the validate checks look up for format ``fmt``."""
    names = [fmt.end_of_turn, fmt.tool_end_of_turn, fmt.think_open, fmt.think_close, *fmt.role_markers,
             *KIMI_TOOL_TOKENS, *fmt.extra.get("tool_tokens", ())]
    return [n for n in names if isinstance(n, str)]


#: text whose encoding tells a tokenizer pipeline that keeps spaces, newlines, digits and CJK from one that does not
_PROBE = "Hello world, 2 + 2 = 4.\n\n  indented line\t東京 café"


#: tokenizer classes that load tokenizer.json as it is (nothing to check)
_AS_FILE = ("PreTrainedTokenizerFast", "TokenizersBackend")


def _as_shipped(tok, path: str):
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
    if backend is None or not os.path.isfile(file) or type(tok).__name__ in _AS_FILE:
        return tok  # the generic classes take tokenizer.json as it is
    from tokenizers import Tokenizer

    want = Tokenizer.from_file(file).encode(_PROBE, add_special_tokens=False).ids
    if backend.encode(_PROBE, add_special_tokens=False).ids == want:
        return tok
    from transformers import PreTrainedTokenizerFast

    logging.getLogger("eagle3_data.templates").warning(
        "%s: transformers loads this tokenizer as %s, which encodes differently from the tokenizer.json it ships "
        "(e.g. spaces dropped); using tokenizer.json as it is", path, type(tok).__name__)
    fixed = PreTrainedTokenizerFast.from_pretrained(path)
    if fixed.backend_tokenizer.encode(_PROBE, add_special_tokens=False).ids != want:
        raise TemplateError(f"{path}: the tokenizer loads with another encoding than its tokenizer.json")
    return fixed


def target_tokens(target: dict, chat_template_kwargs: dict | None = None, lazy: bool = False) -> TargetTokens:
    """:func:`load_target_tokens` from the config ``target`` slice (path, template, trust_remote_code,
    chat_template_kwargs); ``chat_template_kwargs`` given here update the target's (a dataset's
    ``generation.extra_body.chat_template_kwargs``, so generation and tokenize render the same prompt).
    ``lazy``: see :func:`load_target_tokens`.
    """
    kwargs = dict(target.get("chat_template_kwargs") or {})
    kwargs.update(chat_template_kwargs or {})
    return load_target_tokens(
        target["path"],
        target.get("template") or "auto",
        trust_remote_code=bool(target.get("trust_remote_code", False)),
        chat_template_kwargs=kwargs,
        lazy=lazy,
    )
