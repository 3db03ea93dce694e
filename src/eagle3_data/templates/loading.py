"""Target tokenizer loading: :func:`load_target_tokens` / :func:`target_tokens` (from the config ``target``
slice), and the check that a tokenizer encodes as its shipped ``tokenizer.json`` does.
"""

from __future__ import annotations

from .formats import KIMI_TOOL_TOKENS, TemplateError, completion_format
from .shipped import as_shipped
from .target import TargetTokens


def load_target_tokens(
    path: str,
    template: str,
    *,
    trust_remote_code: bool = False,
    chat_template_kwargs: dict | None = None,
    lazy: bool = False,
) -> TargetTokens:
    """Load the target tokenizer from a local directory and bind it to a completion format (family ``template``;
    ``auto``: the one :func:`eagle3_data.templates.auto.detect_family` finds from its chat template).

    ``trust_remote_code`` lets tokenizers that ship their own code load (Kimi's tiktoken-based
    ``tokenization_kimi.py``); never set implicitly. The loaded tokenizer comes from the local cache of
    :mod:`eagle3_data.templates.tokenizer_cache` when the directory's files were loaded before (same hashes, same library
    versions). ``lazy``: when a job already cached the tokenizer's facts (its length, its ids of the format's
    special tokens, :func:`eagle3_data.templates.tokenizer_cache.tokenizer_facts`), the :class:`TargetTokens` wraps a
    :class:`~eagle3_data.templates.tokenizer_cache.LazyTokenizer` that loads the tokenizer only when it must encode,
    decode or render (a validate job that only checks ids does not); the ids and answers are the same. Raises
    :class:`TemplateError` if the directory has no loadable
    tokenizer (the message says when ``target.trust_remote_code: true`` is needed) or no chat template.
    """
    from transformers import AutoTokenizer

    from .tokenizer_cache import LazyTokenizer, cached_facts, load_tokenizer, tokenizer_facts

    fmt = completion_format(template) if template != "auto" else None

    def load():
        try:
            tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        except Exception as exc:
            hint = ""
            if not trust_remote_code and ("trust_remote_code" in str(exc) or "custom code" in str(exc)):
                hint = " (this tokenizer ships its own code: set target.trust_remote_code: true)"
            raise TemplateError(f"{path}: cannot load the target tokenizer: {exc}{hint}") from exc
        return as_shipped(tok, path)

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
    target = TargetTokens(tok, fmt, chat_template_kwargs)
    target.path = str(path)  # the target's folder: its image processor, for a prompt with images (tokens.py)
    return target


def format_token_names(fmt) -> list[str]:
    """Every special-token name :class:`TargetTokens` and the validate checks look up for format ``fmt``."""
    names = [
        fmt.end_of_turn,
        fmt.tool_end_of_turn,
        fmt.think_open,
        fmt.think_close,
        *fmt.role_markers,
        *KIMI_TOOL_TOKENS,
        *fmt.extra.get("tool_tokens", ()),
    ]
    return [n for n in names if isinstance(n, str)]


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
