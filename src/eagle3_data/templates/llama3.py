"""Family ``llama3``: Llama 3.1 / 3.2 / 3.3 instruct (no reasoning; JSON tool calls; ``<|eot_id|>``).

From the Llama 3.1 chat template (meta-llama/Llama-3.1-8B-Instruct ``tokenizer_config.json``, the same text for
Llama 3.3; the copy in ``src/eagle3_data/testing/chat_templates/llama-3.1.jinja``): the generation prompt ends
``<|start_header_id|>assistant<|end_header_id|>\\n\\n``; an answer is ``{content}<|eot_id|>`` (the template trims
history contents); a custom tool call is ``{"name": "{name}", "parameters": {arguments}}<|eot_id|>``, one call per
turn (the template raises on more). Built-in tools (``<|python_tag|>``, ``<|eom_id|>``) are not written.
"""

from __future__ import annotations

from .core import CompletionFormat, TemplateError, args_text, register


def tool_segments(target, tool_calls: list[dict], content: str, prior: int) -> list[tuple[str, bool]]:
    """``content`` or Llama 3.1's JSON tool call. Raises ``TemplateError`` ``tool_calls_unsupported`` for more
    than one call in a turn (Llama 3.1's template renders exactly one)."""
    if not tool_calls:
        return [(content, False)]
    if len(tool_calls) != 1:
        raise TemplateError(
            f"family llama3: {len(tool_calls)} tool calls in one turn; Llama 3.1's template "
            "renders exactly one per assistant message",
            "tool_calls_unsupported",
        )
    fn = tool_calls[0].get("function") or {}
    args = args_text(fn.get("arguments", {})) or "{}"
    return [(content + '{"name": "' + str(fn.get("name", "")) + '", "parameters": ' + args + "}", False)]


FORMAT = register(
    CompletionFormat(
        "llama3",
        "<|eot_id|>",
        None,
        None,
        False,
        "plain",
        "llama3",
        ("<|start_header_id|>", "<|end_header_id|>", "<|begin_of_text|>"),
        tool_args_mapping=True,
    ),
    tool_writer=tool_segments,
)
