"""Target chat templates: prompt rendering with the target's own template and the exact completion format.

The training sequence of a sample is ``prompt_ids + completion_ids`` where

- ``prompt_ids`` come from the target tokenizer's own chat template with ``add_generation_prompt=True``
  (so template quirks such as Kimi's default system prompt or Qwen3's history-reasoning rules are honoured by
  the template itself, never re-implemented), and
- ``completion_ids`` are the tokens the target emits for its answer, built from the response text in the
  target family's completion format (think block, content, tool-call section, end-of-turn token).

Rendering the finished conversation instead is wrong for Kimi/Qwen3 templates: they drop or blank the
reasoning of the final turn (``../shared/reference/formats.md`` §0, §2). Special tokens are looked up by name
in the tokenizer, never hard-coded ids.

Completion formats (source: formats.md §2.2-§2.4, SGLang reasoning parsers):

============== ==================================================================================== =========
family         completion text                                                                      end token
============== ==================================================================================== =========
kimi-k2        content [tool section]                                                               <|im_end|>
kimi-k2-think. <think>reasoning</think>content [tool section]                                       <|im_end|>
kimi-k25       reasoning</think>content [tool section]   (prompt already ends in <think>)           <|im_end|>
qwen3          <think>\\nreasoning\\n</think>\\n\\ncontent [<tool_call> blocks]                          <|im_end|>
deepseek-r1    reasoning</think>content                  (prompt ends in <think>\\n)                 <｜end▁of▁sentence｜>
============== ==================================================================================== =========

When the prompt already ends with the opening think token, the opening token is not part of the completion
(K2.5 thinking mode, Qwen3-2507 thinking, DeepSeek-R1); this is detected from the rendered prompt ids.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Sequence


class TemplateError(ValueError):
    """The target tokenizer or template can't produce the requested sequence; message says why."""


@dataclass(frozen=True)
class CompletionFormat:
    """How a target family writes its completion after the generation prompt.

    Attributes are special-token *names*; ids are resolved from the tokenizer by :class:`TargetTokens`.
    """

    name: str
    end_of_turn: str
    think_open: str | None = None
    think_close: str | None = None
    reasoning: bool = False  # whether the target emits a think block
    think_layout: str = "plain"  # plain: <think>r</think>c ; qwen: <think>\nr\n</think>\n\nc
    tool_format: str = "none"  # kimi | qwen | none
    role_markers: tuple[str, ...] = ()
    extra_end_tokens: tuple[str, ...] = field(default_factory=tuple)


KIMI_ROLE_MARKERS = ("<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>")

FORMATS: dict[str, CompletionFormat] = {
    "kimi-k2": CompletionFormat(
        "kimi-k2", "<|im_end|>", "<think>", "</think>", False, "plain", "kimi", KIMI_ROLE_MARKERS
    ),
    "kimi-k2-thinking": CompletionFormat(
        "kimi-k2-thinking", "<|im_end|>", "<think>", "</think>", True, "plain", "kimi", KIMI_ROLE_MARKERS
    ),
    "kimi-k25": CompletionFormat(
        "kimi-k25", "<|im_end|>", "<think>", "</think>", True, "plain", "kimi", KIMI_ROLE_MARKERS
    ),
    "qwen3": CompletionFormat(
        "qwen3", "<|im_end|>", "<think>", "</think>", True, "qwen", "qwen", ("<|im_start|>",)
    ),
    "deepseek-r1": CompletionFormat(
        "deepseek-r1", "<｜end▁of▁sentence｜>", "<think>", "</think>", True, "plain", "none",
        ("<｜User｜>", "<｜Assistant｜>"),
    ),
}


def completion_format(name: str) -> CompletionFormat:
    """The :class:`CompletionFormat` for a family name from config ``target.template``.

    Raises :class:`TemplateError` listing the known names.
    """
    try:
        return FORMATS[name]
    except KeyError:
        raise TemplateError(f"unknown target.template {name!r}; known: {sorted(FORMATS)}") from None


def normalize_ids(out: Any) -> list[int]:
    """Token ids from whatever ``apply_chat_template(tokenize=True)`` returned, as a flat ``list[int]``.

    transformers 5 may return a ``BatchEncoding`` (a dict: ``len()`` of it is the number of keys, not tokens),
    a tensor, a nested ``[[...]]`` list or a plain list (anchors.md lessons). Raises :class:`TemplateError` on a
    batch of more than one sequence.
    """
    if hasattr(out, "keys") and "input_ids" in out:
        out = out["input_ids"]
    if hasattr(out, "tolist"):
        out = out.tolist()
    out = list(out)
    if out and isinstance(out[0], (list, tuple)):
        if len(out) != 1:
            raise TemplateError(f"expected one sequence from the chat template, got a batch of {len(out)}")
        out = list(out[0])
    return [int(x) for x in out]


class TargetTokens:
    """A loaded target tokenizer plus the ids of its completion format's special tokens.

    ``tokenizer`` is a transformers tokenizer (``AutoTokenizer.from_pretrained`` result). Raises
    :class:`TemplateError` if a special token the format needs is missing from the vocabulary.
    """

    def __init__(self, tokenizer, fmt: CompletionFormat, chat_template_kwargs: dict | None = None):
        self.tok = tokenizer
        self.fmt = fmt
        self.kwargs = dict(chat_template_kwargs or {})
        self.vocab_size = len(tokenizer)
        self.eot_id = self.special_id(fmt.end_of_turn)
        self.think_open_id = self.special_id(fmt.think_open, required=fmt.reasoning)
        self.think_close_id = self.special_id(fmt.think_close, required=fmt.reasoning)
        self.role_marker_ids = {
            i for i in (self.special_id(m, required=False) for m in fmt.role_markers) if i is not None
        }
        specials = {self.eot_id, self.think_open_id, self.think_close_id, *self.role_marker_ids}
        for name in getattr(tokenizer, "all_special_tokens", []) or []:
            i = self.special_id(name, required=False)
            if i is not None:
                specials.add(i)
        for name in (
            "<|tool_calls_section_begin|>",
            "<|tool_calls_section_end|>",
            "<|tool_call_begin|>",
            "<|tool_call_argument_begin|>",
            "<|tool_call_end|>",
        ):
            i = self.special_id(name, required=False)
            if i is not None:
                specials.add(i)
        specials.discard(None)
        self.special_ids: frozenset[int] = frozenset(specials)

    def special_id(self, name: str | None, required: bool = True) -> int | None:
        """Id of the special token ``name`` (by name, never hard-coded); None if absent and not required."""
        if name is None:
            return None
        ids = self.tok.convert_tokens_to_ids([name])
        i = ids[0] if ids else None
        unk = getattr(self.tok, "unk_token_id", None)
        if i is None or (unk is not None and i == unk and name != getattr(self.tok, "unk_token", None)):
            if required:
                raise TemplateError(
                    f"target tokenizer has no special token {name!r} needed by template family {self.fmt.name!r}"
                )
            return None
        return int(i)

    # -- prompt ------------------------------------------------------------------------------------------
    def render_prompt_text(self, messages: list[dict], tools: list[dict] | None) -> str:
        """The chat-template text of ``messages`` with ``add_generation_prompt=True`` (tools passed through)."""
        try:
            return self.tok.apply_chat_template(
                messages, tools=tools or None, add_generation_prompt=True, tokenize=False, **self.kwargs
            )
        except Exception as exc:  # jinja errors (raise_exception in templates), bad roles
            raise TemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from exc

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        """Prompt token ids via ``apply_chat_template(..., add_generation_prompt=True, tokenize=True)``."""
        try:
            out = self.tok.apply_chat_template(
                messages, tools=tools or None, add_generation_prompt=True, tokenize=True, **self.kwargs
            )
        except Exception as exc:
            raise TemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from exc
        return normalize_ids(out)

    def encode_texts(self, texts: Sequence[str]) -> list[list[int]]:
        """Batch-encode plain texts without adding BOS/EOS (one Rust call for a fast tokenizer)."""
        if not texts:
            return []
        enc = self.tok(list(texts), add_special_tokens=False)
        return [list(x) for x in enc["input_ids"]]

    # -- completion --------------------------------------------------------------------------------------
    def completion_segments(
        self, reasoning: str | None, content: str | None, tool_calls: list[dict] | None, prompt_ends_open: bool
    ) -> list[tuple[str, bool]]:
        """The completion as ``[(text, is_special_token_name), ...]`` in the target's exact format.

        Plain-text pieces are encoded on their own, special tokens by name, so text that merely *looks* like a
        special token is never turned into one (validation then catches it as a leaked marker).
        Raises :class:`TemplateError` for reasoning given to a non-reasoning format.
        """
        f = self.fmt
        segs: list[tuple[str, bool]] = []
        reasoning = reasoning or ""
        content = content or ""
        if f.reasoning:
            if f.think_layout == "qwen":
                if not prompt_ends_open:
                    segs.append((f.think_open, True))
                segs.append(("\n" + reasoning.strip("\n") + "\n", False))
                segs.append((f.think_close, True))
                segs.append(("\n\n" + content.lstrip("\n"), False))
            else:
                if not prompt_ends_open:
                    segs.append((f.think_open, True))
                segs.append((reasoning, False))
                segs.append((f.think_close, True))
                segs.append((content, False))
        else:
            if reasoning.strip():
                raise TemplateError(f"response has reasoning but target family {f.name!r} does not reason")
            segs.append((content, False))
        if tool_calls:
            segs.extend(self._tool_segments(tool_calls))
        segs.append((f.end_of_turn, True))
        return [(t, s) for t, s in segs if s or t]

    def _tool_segments(self, tool_calls: list[dict]) -> list[tuple[str, bool]]:
        f = self.fmt
        if f.tool_format == "kimi":
            segs: list[tuple[str, bool]] = [("<|tool_calls_section_begin|>", True)]
            for i, call in enumerate(tool_calls):
                fn = call.get("function", {})
                args = fn.get("arguments", "")
                if not isinstance(args, str):
                    args = json.dumps(args, ensure_ascii=False)
                call_id = call.get("id") or f"functions.{fn.get('name', '')}:{i}"
                segs += [
                    ("<|tool_call_begin|>", True),
                    (call_id, False),
                    ("<|tool_call_argument_begin|>", True),
                    (args, False),
                    ("<|tool_call_end|>", True),
                ]
            segs.append(("<|tool_calls_section_end|>", True))
            return segs
        if f.tool_format == "qwen":
            text = ""
            for call in tool_calls:
                fn = call.get("function", {})
                args = fn.get("arguments", {})
                if isinstance(args, str):
                    try:
                        args = json.loads(args)
                    except json.JSONDecodeError:
                        pass
                text += "\n<tool_call>\n" + json.dumps({"name": fn.get("name"), "arguments": args}, ensure_ascii=False) + "\n</tool_call>"
            return [(text, False)]
        raise TemplateError(f"target family {f.name!r} has no tool-call format")

    def prompt_ends_open(self, prompt_ids: Sequence[int]) -> bool:
        """Whether the rendered prompt already opened the think block (K2.5, DeepSeek-R1, Qwen3-2507)."""
        if self.think_open_id is None or not prompt_ids:
            return False
        tail = list(prompt_ids[-2:])
        if tail[-1] == self.think_open_id:
            return True
        # "<think>\n" prompts: the newline after the open token belongs to the prompt
        return len(tail) == 2 and tail[0] == self.think_open_id and self.tok.decode([tail[1]]) == "\n"


def load_target_tokens(path: str, template: str, *, trust_remote_code: bool = False,
                       chat_template_kwargs: dict | None = None) -> TargetTokens:
    """Load the target tokenizer from a local directory and bind it to a completion format.

    Raises :class:`TemplateError` if the directory has no tokenizer or no chat template.
    """
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise TemplateError(f"{path}: cannot load the target tokenizer: {exc}") from exc
    if not getattr(tok, "chat_template", None):
        raise TemplateError(f"{path}: the target tokenizer has no chat template")
    return TargetTokens(tok, completion_format(template), chat_template_kwargs)
