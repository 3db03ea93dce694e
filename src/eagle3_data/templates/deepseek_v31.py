"""Family ``deepseek-v3.1``: DeepSeek-V3.1 (and V3.1-Terminus), thinking and non-thinking, with tool calls.

From the DeepSeek-V3.1 chat template (deepseek-ai/DeepSeek-V3.1 ``tokenizer_config.json``; the copy in
``src/eagle3_data/testing/chat_templates/deepseek-v3.1.jinja``):

- the generation prompt ends ``<｜Assistant｜><think>`` with ``thinking`` true and ``<｜Assistant｜></think>``
  otherwise (the default), so the completion is ``{reasoning}</think>{answer}<｜end▁of▁sentence｜>`` or
  ``{answer}<｜end▁of▁sentence｜>``: no R1-style newlines around ``</think>`` (family ``deepseek-r1`` would write
  them, so a V3.1 target needs this family);
- after tool results (``<｜tool▁output▁end｜>``) the template adds no generation prompt: the target answers
  ``{answer}<｜end▁of▁sentence｜>`` straight on, without a think block;
- tool calls: ``[content]<｜tool▁calls▁begin｜>`` then per call ``<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>
  {arguments}<｜tool▁call▁end｜>``, then ``<｜tool▁calls▁end｜><｜end▁of▁sentence｜>``; arguments are the JSON text as
  emitted (the template concatenates them as a string);
- history turns keep only the answer (``<｜Assistant｜></think>{answer}``): the final answer's reasoning is not in
  the template's render of a finished conversation, so thinking-mode ids follow SGLang's ``deepseek-v3`` reasoning
  parser convention (``<think>`` is a prompt token, the reasoning ends at ``</think>``).
"""

from __future__ import annotations

from .core import CompletionFormat, args_text, register

DEEPSEEK_TOOL_TOKENS = (
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁sep｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁calls▁end｜>",
)


def tool_segments(target, tool_calls: list[dict], content: str, prior: int) -> list[tuple[str, bool]]:
    """``content`` then DeepSeek-V3.1's tool-call section for ``tool_calls`` (OpenAI shape), as segments."""
    segs: list[tuple[str, bool]] = [(content, False)]
    if not tool_calls:
        return segs
    segs.append(("<｜tool▁calls▁begin｜>", True))
    for call in tool_calls:
        fn = call.get("function") or {}
        segs += [
            ("<｜tool▁call▁begin｜>", True),
            (str(fn.get("name", "")), False),
            ("<｜tool▁sep｜>", True),
            (args_text(fn.get("arguments", "")), False),
            ("<｜tool▁call▁end｜>", True),
        ]
    segs.append(("<｜tool▁calls▁end｜>", True))
    return segs


FORMAT = register(
    CompletionFormat(
        "deepseek-v3.1",
        "<｜end▁of▁sentence｜>",
        "<think>",
        "</think>",
        True,
        "kimi",
        "deepseek",
        ("<｜User｜>", "<｜Assistant｜>", "<｜tool▁output▁begin｜>"),
        think_in_prompt=True,
        extra={"tool_tokens": DEEPSEEK_TOOL_TOKENS},
    ),
    tool_writer=tool_segments,
)
