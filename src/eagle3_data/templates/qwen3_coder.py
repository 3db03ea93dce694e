"""Family ``qwen3-coder``: Qwen3-Coder (no thinking mode; XML tool calls), on Qwen3's vocabulary and layout.

From the Qwen3-Coder chat template (Qwen/Qwen3-Coder-30B-A3B-Instruct ``tokenizer_config.json``; the copy in
``src/eagle3_data/testing/chat_templates/qwen3-coder.jinja``): the generation prompt is ``<|im_start|>assistant\\n``; an answer is
``{content}<|im_end|>``; a tool-call turn is ``[{content.strip()}\\n\\n]<tool_call>\\n<function={name}>\\n`` then per
argument ``<parameter={key}>\\n{value}\\n</parameter>\\n``, then ``</function>\\n</tool_call>``, calls separated by
``\\n``, and ``<|im_end|>``. A string value is written as it is; other values as JSON (``5``, ``true``,
``{"a": 1}``: Qwen's later template revisions write mappings and lists with ``tojson``; the first one wrote
Python's ``str``), which SGLang's / vLLM's ``qwen3_coder`` tool parsers read back by the tool's schema.
"""

from __future__ import annotations

import json

from .core import CompletionFormat, args_mapping, register


def _value(v) -> str:
    return v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)


def tool_segments(target, tool_calls: list[dict], content: str, prior: int) -> list[tuple[str, bool]]:
    """``content`` then Qwen3-Coder's XML tool calls, as one text segment (its tool tokens are ordinary added
    tokens, matched when the text is encoded). Raises ``TemplateError`` ``bad_tool_call`` for arguments that are
    not a JSON object."""
    if not tool_calls:
        return [(content, False)]
    text = content.strip() + "\n\n" if content.strip() else ""
    for i, call in enumerate(tool_calls):
        fn = call.get("function") or {}
        text += ("\n" if i else "") + "<tool_call>\n<function=" + str(fn.get("name", "")) + ">\n"
        for k, v in args_mapping(fn.get("arguments", {})).items():
            text += f"<parameter={k}>\n{_value(v)}\n</parameter>\n"
        text += "</function>\n</tool_call>"
    return [(text, False)]


FORMAT = register(
    CompletionFormat(
        "qwen3-coder", "<|im_end|>", None, None, False, "qwen", "qwen_xml", ("<|im_start|>",), tool_args_mapping=True
    ),
    tool_writer=tool_segments,
)
