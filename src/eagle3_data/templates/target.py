"""The loaded target tokenizer bound to its completion format (:class:`TargetTokens`): prompt and completion ids
and the loss mask of one sample, in the table of :mod:`eagle3_data.templates.core`.
"""

from __future__ import annotations

import json
from typing import Sequence

from .formats import CompletionFormat, KIMI_TOOL_TOKENS, LAYOUT_WRITERS, TOOL_WRITERS, TemplateError
from .replies import (
    KIMI_CALL_ID,
    args_mapping,
    args_text,
    empty_think_block,
    normalize_ids,
    rewrite_kimi_tool_call_ids,
)


class TargetTokens:
    """A loaded target tokenizer plus the ids of its completion format's special tokens.

    ``tokenizer``: a transformers tokenizer (``AutoTokenizer.from_pretrained`` result, fast or slow).
    ``chat_template_kwargs``: extra template variables (``thinking``, ``enable_thinking``, ...).
    Raises :class:`TemplateError` if a token the format needs is missing from the vocabulary.

    Attributes: ``vocab_size`` (``len(tokenizer)``), ``eot_id``, ``end_ids`` (all accepted end-of-turn ids),
    ``think_open_id``/``think_close_id`` (None if absent), ``role_marker_ids`` (frozenset), ``boundary_names``
    (role markers + end tokens, by name: a generation header starts after the last of them).
    """

    def __init__(self, tokenizer, fmt: CompletionFormat, chat_template_kwargs: dict | None = None):
        self.tok = tokenizer
        self.fmt = fmt
        self.kwargs = dict(chat_template_kwargs or {})
        self.vocab_size = len(tokenizer)
        eot_name = fmt.end_of_turn or getattr(tokenizer, "eos_token", None)
        if not eot_name:
            raise TemplateError(f"template family {fmt.name!r}: the tokenizer has no eos_token to end a turn with")
        self.eot_name: str = eot_name
        self.eot_id: int = self.special_id(eot_name)
        self.tool_eot_name = fmt.tool_end_of_turn or eot_name
        self.tool_eot_id: int = self.special_id(self.tool_eot_name)
        self.end_ids: frozenset[int] = frozenset({self.eot_id, self.tool_eot_id})
        need_think = bool(fmt.reasoning)
        self.think_open_id = self.special_id(fmt.think_open, required=need_think)
        self.think_close_id = self.special_id(fmt.think_close, required=need_think)
        self.role_marker_ids: frozenset[int] = (
            frozenset(i for i in (self.special_id(m, required=False) for m in fmt.role_markers) if i is not None)
            - self.end_ids
        )
        if fmt.tool_format == "kimi":
            for name in KIMI_TOOL_TOKENS:
                self.special_id(name)
        for name in fmt.extra.get("tool_tokens", ()):
            self.special_id(name)
        self.boundary_names: tuple[str, ...] = tuple(
            n
            for n in (*fmt.role_markers, eot_name, self.tool_eot_name)
            if self.special_id(n, required=False) is not None
        )

    def special_id(self, name: str | None, required: bool = True) -> int | None:
        """Id of the token ``name`` (looked up by name, never hard-coded); None if absent and not required.

        Raises :class:`TemplateError` when ``required`` and the tokenizer has no such single token.
        """
        if name is None:
            return None
        ids = self.tok.convert_tokens_to_ids([name])
        i = ids[0] if ids else None
        unk = getattr(self.tok, "unk_token_id", None)
        if i is None or (unk is not None and i == unk and name != getattr(self.tok, "unk_token", None)):
            if required:
                raise TemplateError(
                    f"target tokenizer has no token {name!r} needed by template family {self.fmt.name!r}"
                )
            return None
        return int(i)

    # -- prompt ------------------------------------------------------------------------------------------
    def _template_messages(self, messages: list[dict]) -> list[dict]:
        """``messages`` as the template must see them: Kimi history tool-call ids rewritten
        (:func:`rewrite_kimi_tool_call_ids`, the same rewrite the generate stage applies to what it sends), tool-call
        arguments as mappings for templates that iterate them (GLM)."""
        if self.fmt.tool_format == "kimi":
            messages = rewrite_kimi_tool_call_ids(messages)
        field_name = self.fmt.reasoning_field
        if field_name != "reasoning_content":
            messages = [
                {**{k: v for k, v in m.items() if k != "reasoning_content"}, field_name: m["reasoning_content"]}
                if m.get("role") == "assistant" and m.get("reasoning_content") is not None
                else m
                for m in messages
            ]
        if not self.fmt.tool_args_mapping:
            return messages
        out = []
        for m in messages:
            if m.get("tool_calls"):
                m = dict(m)
                calls = []
                for c in m["tool_calls"]:
                    c = dict(c)
                    fn = dict(c.get("function") or {})
                    fn["arguments"] = args_mapping(fn.get("arguments", {}))
                    c["function"] = fn
                    calls.append(c)
                m["tool_calls"] = calls
            out.append(m)
        return out

    def render(self, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool = True) -> str:
        """Chat-template text of ``messages`` (tools and ``chat_template_kwargs`` passed through).

        Raises :class:`TemplateError` (reason ``prompt_render_failed``) for any template failure, e.g. a template's
        ``raise_exception`` on bad role order (vllm-project/speculators PR #801: one bad row must not kill the stage).
        """
        try:
            out = self.tok.apply_chat_template(
                self._template_messages(messages),
                tools=tools or None,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                **self.kwargs,
            )
        except Exception as exc:  # jinja TemplateError (raise_exception), bad roles, missing keys
            raise TemplateError(f"chat template failed: {type(exc).__name__}: {exc}", "prompt_render_failed") from exc
        if isinstance(out, list):  # a batch of one
            out = out[0]
        return out

    def render_prompt_text(self, messages: list[dict], tools: list[dict] | None) -> str:
        """The chat-template text of ``messages`` with ``add_generation_prompt=True``."""
        return self.render(messages, tools, True)

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        """Prompt token ids via ``apply_chat_template(..., add_generation_prompt=True, tokenize=True)``, normalised."""
        try:
            out = self.tok.apply_chat_template(
                self._template_messages(messages),
                tools=tools or None,
                add_generation_prompt=True,
                tokenize=True,
                **self.kwargs,
            )
        except Exception as exc:
            raise TemplateError(f"chat template failed: {type(exc).__name__}: {exc}", "prompt_render_failed") from exc
        return normalize_ids(out)

    def encode_texts(self, texts: Sequence[str]) -> list[list[int]]:
        """Batch-encode plain texts without adding BOS/EOS (one call: parallel in Rust for a fast tokenizer).

        Added tokens (special-token names) inside the texts are matched, as the target's own tokenizer does.
        """
        if not texts:
            return []
        backend = self._backend()
        if backend is not None:  # same ids as tok(texts, add_special_tokens=False), without the per-token
            encode = getattr(backend, "encode_batch_fast", backend.encode_batch)  # Python conversions
            return [e.ids for e in encode(list(texts), add_special_tokens=False)]
        return self.tok(list(texts), add_special_tokens=False)["input_ids"]

    def decode_batch(self, seqs: Sequence[Sequence[int]]) -> list[str]:
        """Decode id sequences keeping every special token as its text, no clean-up of spaces (one batched call)."""
        if not seqs:
            return []
        backend = self._backend()
        if backend is not None:
            return backend.decode_batch(
                [s if isinstance(s, list) else list(s) for s in seqs], skip_special_tokens=False
            )
        return self.tok.batch_decode(seqs, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def _backend(self):
        """The Rust ``tokenizers.Tokenizer`` of a fast tokenizer (None for slow ones, e.g. Kimi's tiktoken)."""
        if getattr(self.tok, "is_fast", False):
            return getattr(self.tok, "backend_tokenizer", None)
        return None

    # -- completion --------------------------------------------------------------------------------------
    def think_state(self, prompt_text: str) -> tuple[str, str]:
        """Whether the generation prompt already holds part of the think block.

        Returns ``(state, trailing)``: ``state`` is ``"none"`` (no think token after the last role/end-of-turn
        marker), ``"open"`` (``<think>`` without ``</think>``: K2.5 thinking, DeepSeek-R1, Qwen3-2507) or
        ``"closed"`` (both: K2.5 ``thinking=False``, Qwen3/GLM ``enable_thinking=False``); ``trailing`` is the
        prompt text after the last think token (e.g. ``"\\n"`` or ``"\\n\\n"``).
        """
        f = self.fmt
        if not f.think_open or self.think_open_id is None:
            return "none", ""
        start = max((prompt_text.rfind(n) for n in self.boundary_names), default=-1)
        tail = prompt_text[max(start, 0) :]
        o = tail.rfind(f.think_open)
        if o < 0:
            c = tail.rfind(f.think_close) if f.think_close else -1
            if c >= 0:  # only the end marker: the prompt closed a think block it never opened (DeepSeek-V3.1 off)
                return "closed", tail[c + len(f.think_close) :]
            return "none", ""
        c = tail.find(f.think_close, o)
        if c < 0:
            return "open", tail[o + len(f.think_open) :]
        return "closed", tail[c + len(f.think_close) :]

    def completion_segments(
        self,
        reasoning: str | None,
        content: str | None,
        tool_calls: list[dict] | None,
        prompt_text: str = "",
        *,
        prior_tool_calls: int = 0,
        truncated: bool = False,
    ) -> list[tuple[str, bool]]:
        """The completion as ``[(text, is_token_name), ...]`` in the target's exact format (adjacent texts merged).

        ``prompt_text`` is the rendered generation prompt (its think state decides what the completion still
        holds); ``prior_tool_calls`` numbers Kimi call ids; ``truncated`` (normalised finish reason ``length``)
        builds the prefix the target emitted before it was cut: no end-of-turn token, and no end-of-reasoning
        marker when the cut fell inside the reasoning (no content yet). Raises :class:`TemplateError` with reason
        ``unexpected_reasoning`` (reasoning for a non-reasoning target or a prompt that closed the think block),
        ``missing_reasoning`` (a thinking prompt but no reasoning: it was hidden, or returned inside the content
        without markers, where it can't be told from the answer), ``truncated_tool_call``,
        ``tool_calls_unsupported``, ``bad_tool_call`` or ``template_mismatch``.
        """
        f = self.fmt
        if f.layout in LAYOUT_WRITERS:
            return merge_segments(
                LAYOUT_WRITERS[f.layout](
                    self,
                    reasoning,
                    content,
                    tool_calls,
                    prompt_text,
                    prior_tool_calls=prior_tool_calls,
                    truncated=truncated,
                )
            )
        r = reasoning or ""
        c = content or ""
        state, trailing = self.think_state(prompt_text) if f.reasoning else ("none", "")
        thinking = bool(f.reasoning) and state != "closed" and not (f.think_in_prompt and state == "none")
        if tool_calls and f.extra.get("tool_calls_unsupported"):
            raise TemplateError(f.extra["tool_calls_unsupported"], "tool_calls_unsupported")
        if tool_calls and truncated:
            raise TemplateError(
                "a cut reply (finish_reason length) with parsed tool calls: where the target stopped "
                "inside its tool-call section is unknown",
                "truncated_tool_call",
            )
        segs: list[tuple[str, bool]] = []
        if f.reasoning and not thinking and state == "none" and f.think_in_prompt:
            if r.strip():
                raise TemplateError(
                    f"response has reasoning but family {f.name!r} does not think after this prompt "
                    "(it opens no think block)",
                    "unexpected_reasoning",
                )
            segs.append((c, False))
        elif f.reasoning:
            if state == "closed" and r.strip():
                raise TemplateError(
                    "response has reasoning but the prompt closed the think block (thinking off)",
                    "unexpected_reasoning",
                )
            if thinking and not r.strip() and not empty_think_block(reasoning, content, tool_calls):
                raise TemplateError(
                    f"target family {f.name!r} thinks after this prompt but the reply has no reasoning: it was hidden "
                    "(e.g. OpenRouter reasoning.exclude) or returned inside the content without its markers, where "
                    "it can't be told from the answer",
                    "missing_reasoning",
                )
            cut_in_reasoning = truncated and thinking and not c
            if f.layout == "qwen":  # Qwen3 template / DeepSeek-R1 output: <think>\n r \n</think>\n\n c
                if cut_in_reasoning:
                    segs += [(f.think_open, True), ("\n" + r.lstrip("\n"), False)]
                else:
                    segs += [
                        (f.think_open, True),
                        ("\n" + r.strip("\n") + "\n", False),
                        (f.think_close, True),
                        ("\n\n" + c.lstrip("\n"), False),
                    ]
            elif f.layout == "glm":
                if cut_in_reasoning:
                    segs += [("\n", False), (f.think_open, True), (r.lstrip(), False)]
                else:
                    body = c.lstrip() if truncated else c.strip()
                    segs += [
                        ("\n", False),
                        (f.think_open, True),
                        (r.strip(), False),
                        (f.think_close, True),
                        (("\n" + body) if body else "", False),
                    ]
            else:
                segs += [(f.think_open, True), (r, False)]
                if not cut_in_reasoning:
                    segs += [(f.think_close, True), (c, False)]
        else:
            if r.strip():
                raise TemplateError(
                    f"response has reasoning but target family {f.name!r} does not reason", "unexpected_reasoning"
                )
            segs.append((c, False))
        if f.tool_format in TOOL_WRITERS:
            if segs and not segs[-1][1]:
                segs.pop()  # the content: the writer places it
            segs += TOOL_WRITERS[f.tool_format](self, tool_calls or [], c, prior_tool_calls)
        elif tool_calls:
            segs += self._tool_segments(tool_calls, c, prior_tool_calls)
        if not truncated:
            segs.append((self.tool_eot_name if tool_calls else self.eot_name, True))
        if state != "none" and f.reasoning:
            segs = self._cut_prompt_part(segs, f.think_open if state == "open" else f.think_close, trailing)
        return merge_segments(segs)

    def _cut_prompt_part(self, segs, marker: str, trailing: str):
        """Drop the segments up to and including ``marker`` and the prompt's ``trailing`` text after it."""
        k = next(i for i, (t, s) in enumerate(segs) if s and t == marker)
        rest = segs[k + 1 :]
        if trailing:
            first = next((i for i, (t, s) in enumerate(rest) if s or t), None)
            if first is None or rest[first][1]:
                raise TemplateError(
                    f"prompt ends with {trailing!r} after {marker}; the completion can't follow it", "template_mismatch"
                )
            text = rest[first][0]
            if text.startswith(trailing):
                text = text[len(trailing) :]
            elif trailing.strip():
                raise TemplateError(
                    f"prompt ends with {trailing!r} after {marker}; the completion starts {text[:20]!r}",
                    "template_mismatch",
                )
            else:  # whitespace the prompt already holds (e.g. DeepSeek-R1 "<think>\n"): not repeated
                text = text.lstrip(trailing)
            rest = rest[:first] + [(text, False)] + rest[first + 1 :]
        return rest

    def _tool_segments(self, tool_calls: list[dict], content: str, prior: int) -> list[tuple[str, bool]]:
        f = self.fmt
        if f.tool_format == "kimi":
            segs: list[tuple[str, bool]] = [("<|tool_calls_section_begin|>", True)]
            for i, call in enumerate(tool_calls):
                fn = call.get("function") or {}
                call_id = call.get("id") or ""
                if not KIMI_CALL_ID.match(call_id):  # provider ids ("call_abc") are not what Kimi emitted
                    call_id = f"functions.{fn.get('name', '')}:{prior + i}"
                segs += [
                    ("<|tool_call_begin|>", True),
                    (call_id, False),
                    ("<|tool_call_argument_begin|>", True),
                    (args_text(fn.get("arguments", "")), False),
                    ("<|tool_call_end|>", True),
                ]
            segs.append(("<|tool_calls_section_end|>", True))
            return segs
        if f.tool_format == "qwen":
            text = ""
            for i, call in enumerate(tool_calls):
                fn = call.get("function") or {}
                if i > 0 or content:
                    text += "\n"
                text += (
                    '<tool_call>\n{"name": "'
                    + str(fn.get("name", ""))
                    + '", "arguments": '
                    + args_text(fn.get("arguments", {}))
                    + "}\n</tool_call>"
                )
            return [(text, False)]
        if f.tool_format == "glm":
            text = ""
            for call in tool_calls:
                fn = call.get("function") or {}
                text += "\n<tool_call>" + str(fn.get("name", "")) + "\n"
                for k, v in args_mapping(fn.get("arguments", {})).items():
                    val = v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)
                    text += f"<arg_key>{k}</arg_key>\n<arg_value>{val}</arg_value>\n"
                text += "</tool_call>"
            return [(text, False)]
        raise TemplateError(f"target family {f.name!r} has no tool-call format", "bad_tool_call")

    def generic_completion(
        self,
        messages: list[dict],
        tools: list[dict] | None,
        prompt_text: str,
        reasoning: str | None,
        content: str | None,
        tool_calls: list[dict] | None,
        truncated: bool = False,
    ) -> str:
        """Completion text for the ``generic`` family: full render minus prompt render, cut after end-of-turn.

        Raises :class:`TemplateError` with reason ``template_not_prefix`` (the prompt render is not a prefix of
        the full render), ``template_no_end_of_turn`` or ``reasoning_dropped_by_template`` / ``content_dropped_by_
        template`` (the template does not render the final turn's reasoning or content, e.g. Kimi's history rule).
        """
        final: dict = {"role": "assistant", "content": content or ""}
        if reasoning:
            final["reasoning_content"] = reasoning
        if tool_calls:
            final["tool_calls"] = tool_calls
        full = self.render(list(messages) + [final], tools, add_generation_prompt=False)
        if not full.startswith(prompt_text):
            i = next((k for k, (a, b) in enumerate(zip(full, prompt_text)) if a != b), min(len(full), len(prompt_text)))
            raise TemplateError(
                f"prompt render is not a prefix of the full render (differs at char {i}: "
                f"{prompt_text[i : i + 30]!r} vs {full[i : i + 30]!r})",
                "template_not_prefix",
            )
        comp = full[len(prompt_text) :]
        end = comp.rfind(self.eot_name)
        if end < 0:
            raise TemplateError(f"full render has no {self.eot_name!r} after the prompt", "template_no_end_of_turn")
        comp = comp[:end] if truncated else comp[: end + len(self.eot_name)]
        if reasoning and reasoning.strip() and reasoning.strip() not in comp:
            raise TemplateError(
                "the chat template does not render the final turn's reasoning", "reasoning_dropped_by_template"
            )
        if content and content.strip() and content.strip() not in comp:
            raise TemplateError(
                "the chat template does not render the final turn's content", "content_dropped_by_template"
            )
        return comp


def merge_segments(segs: list[tuple[str, bool]]) -> list[tuple[str, bool]]:
    out: list[tuple[str, bool]] = []
    for t, s in segs:
        if not s and not t:
            continue
        if not s and out and not out[-1][1]:
            out[-1] = (out[-1][0] + t, False)
        else:
            out.append((t, s))
    return out
