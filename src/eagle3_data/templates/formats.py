"""Completion formats: :class:`CompletionFormat`, the family table ``FORMATS`` (the older families: kimi-k2,
kimi-k2-thinking, kimi-k25, qwen3, qwen3-2507, glm45, deepseek-r1, generic, ...), :func:`register` and the
per-family tool/layout writer tables. The newer families register from their own modules.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class TemplateError(ValueError):
    """The target tokenizer or template can't produce the requested sequence; message says why.

    ``reason`` is the reason code a row is rejected with when this is raised for one sample.
    """

    def __init__(self, message: str, reason: str = "template_error"):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class CompletionFormat:
    """How a target family writes its completion after the generation prompt.

    Token attributes are special-token *names*; ids are resolved from the tokenizer by :class:`TargetTokens`.

    - ``end_of_turn``: the token the target emits to end its turn (``None`` for ``generic``: the tokenizer's eos).
    - ``tool_end_of_turn``: end token after a tool-call turn when it differs (GLM ``<|observation|>``).
    - ``reasoning``: the target emits a think block (``None``: unknown, reasoning checks skipped).
    - ``layout``: ``kimi`` | ``qwen`` | ``glm`` | ``plain`` (think block spacing, see the module table).
    - ``tool_format``: ``kimi`` | ``qwen`` | ``glm`` | ``none``.
    - ``role_markers``: tokens that may never appear inside a completion.
    - ``tool_args_mapping``: the template needs tool-call ``arguments`` as a mapping, not a JSON string (GLM).
    - ``reasoning_field``: the assistant-message key the template reads a history turn's reasoning from
      (``reasoning_content``; gpt-oss: ``thinking``); the prompt messages keep it under ``reasoning_content``.
    - ``think_in_prompt``: the think block is only ever opened by the generation prompt (DeepSeek-V3.1): a prompt
      holding no think token (a turn after tool results) is answered without reasoning.
    """

    name: str
    end_of_turn: str | None
    think_open: str | None = None
    think_close: str | None = None
    reasoning: bool | None = False
    layout: str = "kimi"
    tool_format: str = "none"
    role_markers: tuple[str, ...] = ()
    tool_end_of_turn: str | None = None
    tool_args_mapping: bool = False
    generic: bool = False
    reasoning_field: str = "reasoning_content"
    think_in_prompt: bool = False
    extra: dict = field(default_factory=dict)


KIMI_ROLE_MARKERS = ("<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>")
KIMI_TOOL_TOKENS = (
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
)

#: why family ``deepseek-r1`` rejects tool calls (reason ``tool_calls_unsupported``)
DEEPSEEK_R1_NO_TOOLS = (
    "family deepseek-r1 has no tool-call format: DeepSeek-R1's own chat template renders a call only for an "
    "assistant message whose content is null and leaves a single call's section unclosed (no "
    "<｜tool▁calls▁end｜><｜end▁of▁sentence｜>), so no completion can be checked against it; R1-0528 and V3.1 "
    "write calls in other layouts (function<｜tool▁sep｜>name + a ```json block; name<｜tool▁sep｜>arguments), "
    "which would need their own families"
)

FORMATS: dict[str, CompletionFormat] = {
    "kimi-k2": CompletionFormat(
        "kimi-k2", "<|im_end|>", "<think>", "</think>", False, "kimi", "kimi", KIMI_ROLE_MARKERS
    ),
    "kimi-k2-thinking": CompletionFormat(
        "kimi-k2-thinking", "<|im_end|>", "<think>", "</think>", True, "kimi", "kimi", KIMI_ROLE_MARKERS
    ),
    "kimi-k25": CompletionFormat(
        "kimi-k25", "<|im_end|>", "<think>", "</think>", True, "kimi", "kimi", KIMI_ROLE_MARKERS
    ),
    "qwen3": CompletionFormat("qwen3", "<|im_end|>", "<think>", "</think>", True, "qwen", "qwen", ("<|im_start|>",)),
    "glm45": CompletionFormat(
        "glm45",
        "<|user|>",
        "<think>",
        "</think>",
        True,
        "glm",
        "glm",
        ("[gMASK]", "<sop>", "<|system|>", "<|assistant|>"),
        tool_end_of_turn="<|observation|>",
        tool_args_mapping=True,
    ),
    "deepseek-r1": CompletionFormat(
        "deepseek-r1",
        "<｜end▁of▁sentence｜>",
        "<think>",
        "</think>",
        True,
        "qwen",
        "none",
        ("<｜User｜>", "<｜Assistant｜>"),
        extra={"tool_calls_unsupported": DEEPSEEK_R1_NO_TOOLS},
    ),
    "generic": CompletionFormat("generic", None, None, None, None, "plain", "none", (), generic=True),
}


#: tool-call writers by ``CompletionFormat.tool_format`` for families in their own modules:
#: ``writer(target, tool_calls, content, prior_tool_calls) -> [(text, is_token_name), ...]``, the completion from
#: the content on (content included), without the end-of-turn token
TOOL_WRITERS: dict[str, Any] = {}
#: whole-completion writers by ``CompletionFormat.layout`` (gpt-oss harmony channels): the signature of
#: :meth:`TargetTokens.completion_segments` with the target first
LAYOUT_WRITERS: dict[str, Any] = {}


def register(fmt: CompletionFormat, *, tool_writer=None, layout_writer=None) -> CompletionFormat:
    """Add family ``fmt`` to :data:`FORMATS` (and its writers); returns it. Used by the family modules."""
    FORMATS[fmt.name] = fmt
    if tool_writer is not None:
        TOOL_WRITERS[fmt.tool_format] = tool_writer
    if layout_writer is not None:
        LAYOUT_WRITERS[fmt.layout] = layout_writer
    return fmt


def completion_format(name: str) -> CompletionFormat:
    """The :class:`CompletionFormat` for a family name from config ``target.template``.

    Raises :class:`TemplateError` listing the known names.
    """
    try:
        return FORMATS[name]
    except KeyError:
        raise TemplateError(f"unknown target.template {name!r}; known: {sorted(FORMATS)}") from None
