"""Family ``gpt-oss``: OpenAI gpt-oss in the harmony format (reasoning on channel ``analysis``, tool calls on
``commentary``, the answer on ``final``).

Layout (openai/openai-cookbook ``articles/openai-harmony.md``; the reference renderer ``openai-harmony``; the
gpt-oss chat template, ``src/eagle3_data/testing/chat_templates/gpt-oss.jinja``): the generation prompt ends ``<|start|>assistant``;
the target then writes

- ``<|channel|>analysis<|message|>{reasoning}<|end|><|start|>assistant<|channel|>final<|message|>{answer}<|return|>``
  (``<|return|>`` ends a generation; in stored history a final message ends ``<|end|>`` and the analysis of every
  turn before the last final answer is dropped);
- for a tool call, ``<|channel|>analysis<|message|>{reasoning}<|end|><|start|>assistant<|channel|>commentary
  to=functions.{name} <|constrain|>json<|message|>{arguments}<|call|>`` (``<|call|>`` ends the generation: one call
  per reply; content returned beside a call is the ``commentary`` preamble the model wrote before it,
  ``<|start|>assistant<|channel|>commentary<|message|>{content}<|end|>``).

The template reads a history turn's reasoning from ``thinking`` (not ``reasoning_content``) and needs tool-call
arguments as a mapping (``tojson``); both are handled when the prompt is rendered. The gpt-oss template writes the
render date into its system message (``strftime_now``): generation and tokenize of one row must run the same day,
or pass ``model_identity`` / a fixed system message through ``target.chat_template_kwargs``.
"""

from __future__ import annotations

from .core import CompletionFormat, TemplateError, args_text, register

HARMONY_TOKENS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")


def completion_segments(
    target, reasoning, content, tool_calls, prompt_text, *, prior_tool_calls=0, truncated=False
) -> list[tuple[str, bool]]:
    """The harmony completion after ``<|start|>assistant`` as ``[(text, is_token_name), ...]``.

    Raises :class:`TemplateError`: ``missing_reasoning`` (no reasoning at all: gpt-oss always writes an analysis
    message, so it was hidden), ``empty_answer`` (reasoning, then an empty final message), ``tool_calls_unsupported`` (more than one call: generation stops at the first
    ``<|call|>``), ``truncated_tool_call``, ``template_mismatch`` (the prompt does not end ``<|start|>assistant``).
    """
    if not prompt_text.endswith("<|start|>assistant"):
        raise TemplateError(
            f"gpt-oss prompt does not end with the generation prompt <|start|>assistant (ends {prompt_text[-30:]!r})",
            "template_mismatch",
        )
    r, c = reasoning, content or ""
    if r is None or (not r.strip() and not (c.strip() or tool_calls)):
        raise TemplateError(
            "family 'gpt-oss' always writes an analysis message first but the reply has no "
            "reasoning: it was hidden (e.g. OpenRouter reasoning.exclude)",
            "missing_reasoning",
        )
    if tool_calls and truncated:
        raise TemplateError(
            "a cut reply (finish_reason length) with parsed tool calls: where the target stopped "
            "inside its tool call is unknown",
            "truncated_tool_call",
        )
    if tool_calls and len(tool_calls) > 1:
        raise TemplateError(
            f"{len(tool_calls)} tool calls in one gpt-oss reply: generation ends at the first <|call|>",
            "tool_calls_unsupported",
        )
    if not truncated and not tool_calls and not c.strip():
        raise TemplateError("the reply has reasoning and then an empty final message", "empty_answer")
    segs: list[tuple[str, bool]] = [("<|channel|>", True), ("analysis", False), ("<|message|>", True), (r, False)]
    if truncated and not c:
        return segs  # cut inside the reasoning
    segs.append(("<|end|>", True))
    if tool_calls:
        if c.strip():
            segs += [
                ("<|start|>", True),
                ("assistant", False),
                ("<|channel|>", True),
                ("commentary", False),
                ("<|message|>", True),
                (c, False),
                ("<|end|>", True),
            ]
        fn = tool_calls[0].get("function") or {}
        segs += [
            ("<|start|>", True),
            ("assistant", False),
            ("<|channel|>", True),
            (f"commentary to=functions.{fn.get('name', '')} ", False),
            ("<|constrain|>", True),
            ("json", False),
            ("<|message|>", True),
            (args_text(fn.get("arguments", {})), False),
            ("<|call|>", True),
        ]
        return segs
    segs += [
        ("<|start|>", True),
        ("assistant", False),
        ("<|channel|>", True),
        ("final", False),
        ("<|message|>", True),
        (c, False),
    ]
    if not truncated:
        segs.append(("<|return|>", True))
    return segs


FORMAT = register(
    CompletionFormat(
        "gpt-oss",
        "<|return|>",
        None,
        None,
        True,
        "harmony",
        "harmony",
        (),
        tool_end_of_turn="<|call|>",
        tool_args_mapping=True,
        reasoning_field="thinking",
        extra={"tool_tokens": HARMONY_TOKENS},
    ),
    layout_writer=completion_segments,
)
