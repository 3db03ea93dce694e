"""Target chat templates: prompt rendering with the target's own template and the exact completion format.

The training sequence of a sample is ``prompt_ids + completion_ids`` where

- ``prompt_ids`` come from the target tokenizer's own chat template with ``add_generation_prompt=True`` (tools
  passed through, ``target.chat_template_kwargs`` such as ``thinking`` / ``enable_thinking`` forwarded), so template
  quirks such as Kimi's default system prompt or the history-reasoning rules of Kimi/Qwen3/GLM are honoured by the
  template itself, never re-implemented;
- ``completion_ids`` are the tokens the target emits after that prompt, built from the response text in the
  target family's completion format (think block, content, tool-call section, end-of-turn token).

Rendering the *finished* conversation instead is wrong for reasoning targets: Kimi K2-Thinking/K2.5 render the
final answer with an empty ``<think></think>``, Qwen3 and GLM drop reasoning before the last user turn, DeepSeek-R1
drops it everywhere (their templates under ``tests/chat_templates/``; SpecForge issues #296 and PR #419 on the
"vanishing thought"). Where a template keeps the final turn's reasoning (Qwen3, GLM-4.5, a Kimi tool-calling turn,
K2.6 ``preserve_thinking``) the product's ids equal its render of the finished conversation; elsewhere they follow
SGLang's reasoning-parser convention (``tests/test_real_vocab.py``).

What is supervised for each kind of reply (R reasoning, C content; the loss mask covers exactly the text shown,
after the generation prompt). Every reply's finish reason is first normalised once into the closed set
:data:`FINISH_REASONS` (:func:`normalize_finish_reason`: unknown values rejected ``unknown_finish_reason`` by
name; a billed completion count at the request's ``max_tokens`` means cut whatever the string says). Cut replies
are kept only with ``validate.keep_truncated`` (else rejected ``truncated``) and end where the target stopped: no
end-of-reasoning marker when cut inside the reasoning, never an end-of-turn token; a cut reply with tool calls is
rejected ``truncated_tool_call``. A think block returned inside the content (a server without a reasoning parser)
is split the way the family's template and SGLang's parsers split it, kept, and counted
(``reasoning_split_from_content`` in the tokenize summary); reasoning prose in the content with no markers, on a
prompt that leaves thinking on, can't be told from the answer and is rejected ``missing_reasoning``. An empty or
whitespace-only think block the target really emitted (reasoning ``""`` or ``"\\n\\n"`` rather than None, or
the block inside the content, followed by an answer or a tool call) is kept exact in the family's layout (Qwen3:
``<think>\\n\\n</think>\\n\\n``; :func:`empty_think_block`).

| family | complete | cut (normalised `length`) | filtered (`content_filter`) | empty answer (reasoning, then nothing) | tool calls | reasoning in content |
|---|---|---|---|---|---|---|
| `kimi-k2` | `C<\\|im_end\\|>` | `C` as emitted, no `<\\|im_end\\|>` | rejected `content_filter` | whitespace-only `C`: `empty_answer`; any reasoning: `unexpected_reasoning` | `C<\\|tool_calls_section_begin\\|>…<\\|tool_calls_section_end\\|><\\|im_end\\|>`, ids `functions.<name>:<n>` | a think block: `reasoning_marker_leak` |
| `kimi-k2-thinking` | `<think>R</think>C<\\|im_end\\|>` | in R: `<think>R`; in C: `<think>R</think>C` | rejected `content_filter` | rejected `empty_answer` | `<think>R</think>C` + Kimi section + `<\\|im_end\\|>` | `<think>R</think>C`: split, kept, counted; prose without markers: `missing_reasoning` |
| `kimi-k25` (K2.5, K2.6) | thinking: `R</think>C<\\|im_end\\|>` (`<think>` is a prompt token); `thinking=False`: `C<\\|im_end\\|>` | thinking: `R` / `R</think>C`; off: `C` | rejected `content_filter` | rejected `empty_answer` | as complete + Kimi section before `<\\|im_end\\|>` | `R</think>C`: split; prose: `missing_reasoning` (thinking on) |
| `qwen3` (Qwen3, Qwen3-2507 thinking) | `<think>\\nR\\n</think>\\n\\nC<\\|im_end\\|>` (2507: `<think>\\n` in the prompt); `enable_thinking=False`: `C<\\|im_end\\|>` | `<think>\\nR` / `<think>\\nR\\n</think>\\n\\nC` | rejected `content_filter` | rejected `empty_answer` | `…</think>\\n\\n[C\\n]<tool_call>\\n{"name": n, "arguments": a}\\n</tool_call><\\|im_end\\|>` | `<think>…</think>` split; prose: `missing_reasoning` (thinking on) |
| `glm45` | `\\n<think>R</think>\\nC<\\|user\\|>` (no end token: the next role token); `enable_thinking=False`: `\\nC<\\|user\\|>` | `\\n<think>R` / `\\n<think>R</think>\\nC` | rejected `content_filter` | rejected `empty_answer` | `…\\n<tool_call>name\\n<arg_key>k</arg_key>\\n<arg_value>v</arg_value>\\n</tool_call><\\|observation\\|>` | split; prose: `missing_reasoning` (thinking on) |
| `deepseek-r1` | `R\\n</think>\\n\\nC<｜end▁of▁sentence｜>` (`<think>\\n` is a prompt token; R1's separators rebuilt) | `R` / `R\\n</think>\\n\\nC` | rejected `content_filter` | rejected `empty_answer` | rejected `tool_calls_unsupported` (R1's template has no usable call layout) | split; prose: `missing_reasoning` |
| `deepseek-v3.1` | thinking: `R</think>C<｜end▁of▁sentence｜>` (`<think>` is a prompt token, no R1 newlines); off: `C<｜end▁of▁sentence｜>` (the prompt ends `</think>`); after tool results: `C<｜end▁of▁sentence｜>` | thinking: `R` / `R</think>C`; off: `C` | rejected `content_filter` | rejected `empty_answer` | `C<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>name<｜tool▁sep｜>args<｜tool▁call▁end｜>…<｜tool▁calls▁end｜><｜end▁of▁sentence｜>` | split; prose: `missing_reasoning` (thinking on) |
| `qwen3-coder` | `C<\|im_end\|>` | `C` as emitted | rejected `content_filter` | whitespace-only `C`: `empty_answer`; any reasoning: `unexpected_reasoning` | `[C.strip()\n\n]<tool_call>\n<function=n>\n<parameter=k>\nv\n</parameter>\n</function>\n</tool_call><\|im_end\|>` | a think block: `reasoning_marker_leak` |
| `llama3` (3.1, 3.3) | `C<\|eot_id\|>` | `C` as emitted | rejected `content_filter` | whitespace-only `C`: `empty_answer` | `{"name": n, "parameters": a}<\|eot_id\|>` (one call per turn, else `tool_calls_unsupported`) | not split |
| `gpt-oss` | `<\|channel\|>analysis<\|message\|>R<\|end\|><\|start\|>assistant<\|channel\|>final<\|message\|>C<\|return\|>` | in R: `<\|channel\|>analysis<\|message\|>R`; in C: without `<\|return\|>` | rejected `content_filter` | rejected `empty_answer` | `…R<\|end\|><\|start\|>assistant<\|channel\|>commentary to=functions.n <\|constrain\|>json<\|message\|>a<\|call\|>` (one call: generation stops at `<\|call\|>`) | not split; no reasoning at all: `missing_reasoning` |
| `generic` | the template's render of the finished conversation minus the prompt render | the same without the end-of-turn token | rejected `content_filter` | whitespace-only completion: `empty_answer` (the markers are unknown) | as the template renders them | passed to the template as content (no split); reasoning the template drops: `reasoning_dropped_by_template` |

Completion formats (the real templates' assistant branches; SGLang reasoning parsers):

================ =============================================================================== ======================
family           completion text after the generation prompt                                     end-of-turn token
================ =============================================================================== ======================
kimi-k2          content [kimi tool section]                                                     ``<|im_end|>``
kimi-k2-thinking ``<think>`` reasoning ``</think>`` content [kimi tool section]                  ``<|im_end|>``
kimi-k25         same as kimi-k2-thinking; the prompt ends in ``<think>`` (thinking) or          ``<|im_end|>``
                 ``<think></think>`` (``thinking=False``), which is then not part of the completion
qwen3            ``<think>`` ``\\n{r.strip('\\n')}\\n`` ``</think>`` ``\\n\\n{c.lstrip('\\n')}``      ``<|im_end|>``
                 [``\\n`` if content] ``<tool_call>\\n{"name": n, "arguments": a}\\n</tool_call>``
                 (``\\n`` between calls); ``enable_thinking=False`` prompts end ``</think>\\n\\n``
glm45            ``\\n`` ``<think>`` ``{r.strip()}`` ``</think>`` [``\\n{c.strip()}``]                 ``<|user|>``, or
                 [``\\n<tool_call>{name}\\n<arg_key>k</arg_key>\\n<arg_value>v</arg_value>\\n</tool_call>``]  ``<|observation|>``
                 (no per-turn end token: the turn ends at the next role token)                  after tool calls
deepseek-r1      as qwen3, without tool calls (the prompt ends ``<think>\\n``)                    ``<｜end▁of▁sentence｜>``
generic          derived: render the conversation with the final assistant message               tokenizer eos token
                 (``add_generation_prompt=False``) and without it (``=True``); the completion is the
                 difference, which must extend the prompt render (else reject ``template_not_prefix``)
================ =============================================================================== ======================

Whether the prompt already opened (K2.5 thinking, Qwen3-2507 thinking, DeepSeek-R1, GLM-5) or opened *and* closed
(K2.5 ``thinking=False``, Qwen3/GLM ``enable_thinking=False``) the think block is read from the rendered prompt
text after its last role/end-of-turn marker; the part the prompt already holds is cut from the completion.

Text pieces are encoded with the tokenizer's normal added-token matching, so a marker that appears as *text* in a
response (e.g. ``</think>`` inside the answer) becomes the marker's id, as the target would have emitted it, and
validation rejects the sample (``reasoning_marker_leak``, ``role_marker_leak``, ``early_end_of_turn``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Sequence


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
    "kimi-k2": CompletionFormat("kimi-k2", "<|im_end|>", "<think>", "</think>", False, "kimi", "kimi",
                                KIMI_ROLE_MARKERS),
    "kimi-k2-thinking": CompletionFormat("kimi-k2-thinking", "<|im_end|>", "<think>", "</think>", True, "kimi",
                                         "kimi", KIMI_ROLE_MARKERS),
    "kimi-k25": CompletionFormat("kimi-k25", "<|im_end|>", "<think>", "</think>", True, "kimi", "kimi",
                                 KIMI_ROLE_MARKERS),
    "qwen3": CompletionFormat("qwen3", "<|im_end|>", "<think>", "</think>", True, "qwen", "qwen",
                              ("<|im_start|>",)),
    "glm45": CompletionFormat("glm45", "<|user|>", "<think>", "</think>", True, "glm", "glm",
                              ("[gMASK]", "<sop>", "<|system|>", "<|assistant|>"),
                              tool_end_of_turn="<|observation|>", tool_args_mapping=True),
    "deepseek-r1": CompletionFormat("deepseek-r1", "<｜end▁of▁sentence｜>", "<think>", "</think>", True, "qwen",
                                    "none", ("<｜User｜>", "<｜Assistant｜>"),
                                    extra={"tool_calls_unsupported": DEEPSEEK_R1_NO_TOOLS}),
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


def normalize_ids(out: Any) -> list[int]:
    """Token ids from whatever ``apply_chat_template(tokenize=True)`` or a tokenizer call returned, as ``list[int]``.

    transformers 5 may return a ``BatchEncoding``/dict (``len()`` of it is the number of keys, not tokens: the
    bug NVIDIA Model-Optimizer PR #2172 fixed), a torch/numpy tensor of shape ``(n,)`` or ``(1, n)``, a nested
    ``[[...]]`` list or a plain list. Raises :class:`TemplateError` on a batch of more than one sequence or on an
    object with no ids.
    """
    if hasattr(out, "keys"):
        if "input_ids" not in out:
            raise TemplateError(f"chat template output has no input_ids (keys {list(out.keys())})")
        out = out["input_ids"]
    if hasattr(out, "ids") and not isinstance(out, (list, tuple)):  # tokenizers.Encoding
        out = out.ids
    if hasattr(out, "tolist"):
        out = out.tolist()
    if isinstance(out, int):
        return [out]
    out = list(out)
    if out and isinstance(out[0], (list, tuple)) or (out and hasattr(out[0], "tolist") and not isinstance(out[0], int)
                                                     and getattr(out[0], "ndim", 0) > 0):
        if len(out) != 1:
            raise TemplateError(f"expected one sequence from the chat template, got a batch of {len(out)}")
        inner = out[0]
        out = inner.tolist() if hasattr(inner, "tolist") else list(inner)
    return [int(x) for x in out]


_KIMI_CALL_ID = re.compile(r"^functions\.[^:\s]+:\d+$")


def _args_text(args: Any) -> str:
    """Tool-call arguments as the target wrote them: a string as-is, anything else as JSON (``tojson``)."""
    if isinstance(args, str):
        return args
    return json.dumps(args, ensure_ascii=False)


def _args_mapping(args: Any) -> dict:
    if isinstance(args, dict):
        return args
    if isinstance(args, str):
        try:
            val = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as exc:
            raise TemplateError(f"tool-call arguments are not JSON: {args[:80]!r}", "bad_tool_call") from exc
        if isinstance(val, dict):
            return val
    raise TemplateError(f"tool-call arguments must be a JSON object, got {str(args)[:80]!r}", "bad_tool_call")


def count_tool_calls(messages: Sequence[dict]) -> int:
    """Number of tool calls in earlier assistant messages (Kimi numbers call ids ``functions.{name}:{index}``
    with this global index; SGLang's kimi_k2 parser does the same)."""
    return sum(len(m.get("tool_calls") or []) for m in messages if m.get("role") == "assistant")


#: The closed set of finish reasons every response is normalised to (:func:`normalize_finish_reason`).
FINISH_REASONS = ("stop", "length", "tool_calls", "content_filter")

#: Finish-reason spellings of the APIs this project talks to (OpenAI / OpenRouter ``finish_reason``, OpenRouter
#: ``native_finish_reason`` of Anthropic and Google providers, SGLang, vLLM, ``transformers serve``), lower-cased.
FINISH_ALIASES = {
    "stop": "stop", "eos": "stop", "eos_token": "stop", "end_turn": "stop", "stop_sequence": "stop",
    "finish_reason_stop": "stop",
    "length": "length", "max_tokens": "length", "max_output_tokens": "length", "max_new_tokens": "length",
    "model_length": "length", "max_length": "length",
    "tool_calls": "tool_calls", "function_call": "tool_calls", "tool_use": "tool_calls",
    "content_filter": "content_filter", "safety": "content_filter", "recitation": "content_filter",
    "prohibited_content": "content_filter", "blocklist": "content_filter", "spii": "content_filter",
    "refusal": "content_filter", "image_safety": "content_filter",
}


def normalize_finish_reason(raw: Any, billed_completion_tokens: int | None = None, max_tokens: int | None = None,
                            *, emitted_end_of_turn: bool = False) -> str:
    """The finish reason of a response as one of :data:`FINISH_REASONS`.

    ``raw`` is the backend's string (any case; spellings in :data:`FINISH_ALIASES`) or None. A billed completion
    count at (or above) the request's ``max_tokens`` means the reply was cut, whatever the string says (providers
    report ``stop``, ``MAX_TOKENS`` or nothing for a reply that ran out of tokens), unless the backend's exact ids
    end in the target's end-of-turn token (``emitted_end_of_turn``: the target stopped by itself on its last
    allowed token). ``content_filter`` wins over everything (the provider cut or replaced the text).

    Raises :class:`TemplateError` with reason ``unknown_finish_reason`` for a value outside the aliases (named in
    the message, e.g. ``abort``) and for a null finish reason that no count or end-of-turn id explains.
    """
    key = raw.strip().lower() if isinstance(raw, str) and raw.strip() else None
    kind = FINISH_ALIASES.get(key) if key is not None else None
    if key is not None and kind is None:
        raise TemplateError(f"unknown finish_reason {raw!r} (known: {sorted(set(FINISH_ALIASES))})",
                            "unknown_finish_reason")
    if kind == "content_filter":
        return kind
    at_max = (billed_completion_tokens is not None and max_tokens is not None and int(max_tokens) > 0
              and int(billed_completion_tokens) >= int(max_tokens))
    if at_max and not emitted_end_of_turn:
        return "length"
    if kind is None:
        if emitted_end_of_turn:
            return "stop"
        raise TemplateError("finish_reason is null and the billed completion count "
                            f"({billed_completion_tokens}) is below max_tokens ({max_tokens}): whether the reply is "
                            "complete is unknown", "unknown_finish_reason")
    return kind


def rewrite_kimi_tool_call_ids(messages: Sequence[dict]) -> list[dict]:
    """History tool-call ids in Kimi's own ``functions.<name>:<index>`` form (``index``: the call's position among
    every tool call of the conversation, counted from 0, as Kimi and SGLang's kimi_k2 tool parser number them).

    Kimi's templates print a history call's ``id`` verbatim, so an OpenAI-style id (``call_0``, ``toolu_...``)
    leaves the prompt without the called function's name. Ids already in Kimi form are kept; every other id is
    rewritten, and so is the ``tool_call_id`` of the tool messages answering it (a tool message without one gets
    the id of the next call not yet answered). Returns a new list (changed messages copied, the input untouched).
    """
    out: list[dict] = []
    mapping: dict[str, str] = {}
    pending: list[str] = []
    index = 0
    for m in messages:
        role = m.get("role")
        if role == "assistant" and m.get("tool_calls"):
            calls = []
            changed = False
            for call in m["tool_calls"]:
                old = call.get("id")
                name = str((call.get("function") or {}).get("name", ""))
                new = old if isinstance(old, str) and _KIMI_CALL_ID.match(old) else f"functions.{name}:{index}"
                index += 1
                if new != old:
                    call = {**call, "id": new}
                    changed = True
                if old is not None:
                    mapping[str(old)] = new
                pending.append(new)
                calls.append(call)
            out.append({**m, "tool_calls": calls} if changed else m)
            continue
        if role == "tool":
            tid = m.get("tool_call_id")
            new = mapping.get(str(tid)) if tid is not None else (pending[0] if pending else None)
            if new is not None and new in pending:
                pending.remove(new)
            if new is not None and new != tid:
                m = {**m, "tool_call_id": new}
        out.append(m)
    return out


def split_reasoning_from_content(fmt: CompletionFormat, content: str | None) -> tuple[str, str] | None:
    """``(reasoning, content)`` from a reply whose think block came back inside ``content`` (a server without a
    reasoning parser, or ``separate_reasoning: false``), or None when ``content`` holds no end-of-reasoning marker.

    The split is the one the target family's own template applies to such a message and SGLang's reasoning
    parsers apply to raw output: the reasoning is the text before the first ``</think>`` (after an opening
    ``<think>`` when present: the K2.5/R1/Qwen3-2507 prompts already hold it), the content the text after it.
    Whitespace is returned as written: the family's layout rebuilds its canonical separators. Text before the
    opening marker other than whitespace is not a think block: None (validation then rejects the marker).
    """
    close, open_ = fmt.think_close, fmt.think_open
    if not fmt.reasoning or not close or not content or close not in content:
        return None
    pre, post = content.split(close, 1)
    if open_ and open_ in pre:
        before, pre = pre.split(open_, 1)
        if before.strip():
            return None
    if open_ and open_ in pre:
        return None
    return pre, post


def empty_think_block(reasoning: str | None, content: str | None, tool_calls: list | None) -> bool:
    """True when a reply on a thinking prompt really holds an empty (or whitespace-only) think block: its reasoning
    is a string (``""``, ``"\\n\\n"``: the server's parser found the markers with nothing between them, or the
    block came back inside the content) and an answer or tool call follows. Such a reply is kept exact (Qwen3:
    ``<think>\\n\\n</think>\\n\\n``); a reasoning of None (hidden, e.g. OpenRouter ``reasoning.exclude``) is not."""
    return reasoning is not None and not reasoning.strip() and bool((content or "").strip() or tool_calls)


def thinking_enabled(template: str | None, chat_template_kwargs: dict | None = None) -> bool:
    """True when target family ``template`` reasons after a generation prompt rendered with
    ``chat_template_kwargs``: a reasoning family whose ``thinking`` / ``enable_thinking`` is not false (SGLang's
    rule for the kimi_k2, qwen3 and glm45 reasoning parsers); ``deepseek-v3.1`` only when one of them is true (its
    template's default is off, SGLang's deepseek-v3 rule). Unknown families: False."""
    fmt = FORMATS.get(template or "")
    kw = chat_template_kwargs or {}
    if fmt is not None and fmt.think_in_prompt:  # DeepSeek-V3.1: off unless asked for (SGLang's deepseek-v3 rule)
        return bool(kw.get("thinking") or kw.get("enable_thinking"))
    return bool(fmt and fmt.reasoning) and kw.get("thinking") is not False and kw.get("enable_thinking") is not False


def request_messages(messages: Sequence[dict], template: str | None) -> list[dict]:
    """The prompt messages of a request to a target of family ``template``, as sent and as later rendered by the
    tokenize stage: Kimi families get their history tool-call ids rewritten (:func:`rewrite_kimi_tool_call_ids`),
    so the prompt the server sees names every called function; other families unchanged."""
    fmt = FORMATS.get(template or "")
    if fmt is not None and fmt.tool_format == "kimi":
        return rewrite_kimi_tool_call_ids(messages)
    return list(messages)


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
        self.role_marker_ids: frozenset[int] = frozenset(
            i for i in (self.special_id(m, required=False) for m in fmt.role_markers) if i is not None
        ) - self.end_ids
        if fmt.tool_format == "kimi":
            for name in KIMI_TOOL_TOKENS:
                self.special_id(name)
        for name in fmt.extra.get("tool_tokens", ()):
            self.special_id(name)
        self.boundary_names: tuple[str, ...] = tuple(
            n for n in (*fmt.role_markers, eot_name, self.tool_eot_name)
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
            messages = [{**{k: v for k, v in m.items() if k != "reasoning_content"}, field_name: m["reasoning_content"]}
                        if m.get("role") == "assistant" and m.get("reasoning_content") is not None else m
                        for m in messages]
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
                    fn["arguments"] = _args_mapping(fn.get("arguments", {}))
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
                self._template_messages(messages), tools=tools or None, add_generation_prompt=add_generation_prompt,
                tokenize=False, **self.kwargs,
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
                self._template_messages(messages), tools=tools or None, add_generation_prompt=True, tokenize=True,
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
            return backend.decode_batch([s if isinstance(s, list) else list(s) for s in seqs],
                                        skip_special_tokens=False)
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
        tail = prompt_text[max(start, 0):]
        o = tail.rfind(f.think_open)
        if o < 0:
            c = tail.rfind(f.think_close) if f.think_close else -1
            if c >= 0:  # only the end marker: the prompt closed a think block it never opened (DeepSeek-V3.1 off)
                return "closed", tail[c + len(f.think_close):]
            return "none", ""
        c = tail.find(f.think_close, o)
        if c < 0:
            return "open", tail[o + len(f.think_open):]
        return "closed", tail[c + len(f.think_close):]

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
            return _merge(LAYOUT_WRITERS[f.layout](self, reasoning, content, tool_calls, prompt_text,
                                                   prior_tool_calls=prior_tool_calls, truncated=truncated))
        r = reasoning or ""
        c = content or ""
        state, trailing = self.think_state(prompt_text) if f.reasoning else ("none", "")
        thinking = bool(f.reasoning) and state != "closed" and not (f.think_in_prompt and state == "none")
        if tool_calls and f.extra.get("tool_calls_unsupported"):
            raise TemplateError(f.extra["tool_calls_unsupported"], "tool_calls_unsupported")
        if tool_calls and truncated:
            raise TemplateError("a cut reply (finish_reason length) with parsed tool calls: where the target stopped "
                                "inside its tool-call section is unknown", "truncated_tool_call")
        segs: list[tuple[str, bool]] = []
        if f.reasoning and not thinking and state == "none" and f.think_in_prompt:
            if r.strip():
                raise TemplateError(f"response has reasoning but family {f.name!r} does not think after this prompt "
                                    "(it opens no think block)", "unexpected_reasoning")
            segs.append((c, False))
        elif f.reasoning:
            if state == "closed" and r.strip():
                raise TemplateError("response has reasoning but the prompt closed the think block (thinking off)",
                                    "unexpected_reasoning")
            if thinking and not r.strip() and not empty_think_block(reasoning, content, tool_calls):
                raise TemplateError(
                    f"target family {f.name!r} thinks after this prompt but the reply has no reasoning: it was hidden "
                    "(e.g. OpenRouter reasoning.exclude) or returned inside the content without its markers, where "
                    "it can't be told from the answer", "missing_reasoning")
            cut_in_reasoning = truncated and thinking and not c
            if f.layout == "qwen":  # Qwen3 template / DeepSeek-R1 output: <think>\n r \n</think>\n\n c
                if cut_in_reasoning:
                    segs += [(f.think_open, True), ("\n" + r.lstrip("\n"), False)]
                else:
                    segs += [(f.think_open, True), ("\n" + r.strip("\n") + "\n", False), (f.think_close, True),
                             ("\n\n" + c.lstrip("\n"), False)]
            elif f.layout == "glm":
                if cut_in_reasoning:
                    segs += [("\n", False), (f.think_open, True), (r.lstrip(), False)]
                else:
                    body = c.lstrip() if truncated else c.strip()
                    segs += [("\n", False), (f.think_open, True), (r.strip(), False), (f.think_close, True),
                             (("\n" + body) if body else "", False)]
            else:
                segs += [(f.think_open, True), (r, False)]
                if not cut_in_reasoning:
                    segs += [(f.think_close, True), (c, False)]
        else:
            if r.strip():
                raise TemplateError(f"response has reasoning but target family {f.name!r} does not reason",
                                    "unexpected_reasoning")
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
        return _merge(segs)

    def _cut_prompt_part(self, segs, marker: str, trailing: str):
        """Drop the segments up to and including ``marker`` and the prompt's ``trailing`` text after it."""
        k = next(i for i, (t, s) in enumerate(segs) if s and t == marker)
        rest = segs[k + 1:]
        if trailing:
            first = next((i for i, (t, s) in enumerate(rest) if s or t), None)
            if first is None or rest[first][1]:
                raise TemplateError(f"prompt ends with {trailing!r} after {marker}; the completion can't follow it",
                                    "template_mismatch")
            text = rest[first][0]
            if text.startswith(trailing):
                text = text[len(trailing):]
            elif trailing.strip():
                raise TemplateError(f"prompt ends with {trailing!r} after {marker}; the completion starts "
                                    f"{text[:20]!r}", "template_mismatch")
            else:  # whitespace the prompt already holds (e.g. DeepSeek-R1 "<think>\n"): not repeated
                text = text.lstrip(trailing)
            rest = rest[:first] + [(text, False)] + rest[first + 1:]
        return rest

    def _tool_segments(self, tool_calls: list[dict], content: str, prior: int) -> list[tuple[str, bool]]:
        f = self.fmt
        if f.tool_format == "kimi":
            segs: list[tuple[str, bool]] = [("<|tool_calls_section_begin|>", True)]
            for i, call in enumerate(tool_calls):
                fn = call.get("function") or {}
                call_id = call.get("id") or ""
                if not _KIMI_CALL_ID.match(call_id):  # provider ids ("call_abc") are not what Kimi emitted
                    call_id = f"functions.{fn.get('name', '')}:{prior + i}"
                segs += [("<|tool_call_begin|>", True), (call_id, False), ("<|tool_call_argument_begin|>", True),
                         (_args_text(fn.get("arguments", "")), False), ("<|tool_call_end|>", True)]
            segs.append(("<|tool_calls_section_end|>", True))
            return segs
        if f.tool_format == "qwen":
            text = ""
            for i, call in enumerate(tool_calls):
                fn = call.get("function") or {}
                if i > 0 or content:
                    text += "\n"
                text += ('<tool_call>\n{"name": "' + str(fn.get("name", "")) + '", "arguments": '
                         + _args_text(fn.get("arguments", {})) + "}\n</tool_call>")
            return [(text, False)]
        if f.tool_format == "glm":
            text = ""
            for call in tool_calls:
                fn = call.get("function") or {}
                text += "\n<tool_call>" + str(fn.get("name", "")) + "\n"
                for k, v in _args_mapping(fn.get("arguments", {})).items():
                    val = v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)
                    text += f"<arg_key>{k}</arg_key>\n<arg_value>{val}</arg_value>\n"
                text += "</tool_call>"
            return [(text, False)]
        raise TemplateError(f"target family {f.name!r} has no tool-call format", "bad_tool_call")

    def generic_completion(self, messages: list[dict], tools: list[dict] | None, prompt_text: str,
                           reasoning: str | None, content: str | None, tool_calls: list[dict] | None,
                           truncated: bool = False) -> str:
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
                f"{prompt_text[i:i + 30]!r} vs {full[i:i + 30]!r})", "template_not_prefix")
        comp = full[len(prompt_text):]
        end = comp.rfind(self.eot_name)
        if end < 0:
            raise TemplateError(f"full render has no {self.eot_name!r} after the prompt", "template_no_end_of_turn")
        comp = comp[:end] if truncated else comp[: end + len(self.eot_name)]
        if reasoning and reasoning.strip() and reasoning.strip() not in comp:
            raise TemplateError("the chat template does not render the final turn's reasoning",
                                "reasoning_dropped_by_template")
        if content and content.strip() and content.strip() not in comp:
            raise TemplateError("the chat template does not render the final turn's content",
                                "content_dropped_by_template")
        return comp


def _merge(segs: list[tuple[str, bool]]) -> list[tuple[str, bool]]:
    out: list[tuple[str, bool]] = []
    for t, s in segs:
        if not s and not t:
            continue
        if not s and out and not out[-1][1]:
            out[-1] = (out[-1][0] + t, False)
        else:
            out.append((t, s))
    return out


def load_target_tokens(path: str, template: str, *, trust_remote_code: bool = False,
                       chat_template_kwargs: dict | None = None) -> TargetTokens:
    """Load the target tokenizer from a local directory and bind it to a completion format (family ``template``;
    ``auto``: the one :func:`eagle3_data.templates.auto.detect_family` finds from its chat template).

    ``trust_remote_code`` lets tokenizers that ship their own code load (Kimi's tiktoken-based
    ``tokenization_kimi.py``); never set implicitly. Raises :class:`TemplateError` if the directory has no loadable
    tokenizer (the message says when ``target.trust_remote_code: true`` is needed) or no chat template.
    """
    from transformers import AutoTokenizer

    fmt = completion_format(template) if template != "auto" else None
    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as exc:
        hint = ""
        if not trust_remote_code and ("trust_remote_code" in str(exc) or "custom code" in str(exc)):
            hint = " (this tokenizer ships its own code: set target.trust_remote_code: true)"
        raise TemplateError(f"{path}: cannot load the target tokenizer: {exc}{hint}") from exc
    tok = _as_shipped(tok, path)
    if not getattr(tok, "chat_template", None):
        raise TemplateError(f"{path}: the target tokenizer has no chat template")
    if fmt is None:  # template: auto (the config check resolves it before any job; here for direct callers)
        from .auto import detect_family

        fmt = completion_format(detect_family(tok, chat_template_kwargs)["family"])
    return TargetTokens(tok, fmt, chat_template_kwargs)


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


def target_tokens(target: dict, chat_template_kwargs: dict | None = None) -> TargetTokens:
    """:func:`load_target_tokens` from the config ``target`` slice (path, template, trust_remote_code,
    chat_template_kwargs); ``chat_template_kwargs`` given here update the target's (a dataset's
    ``generation.extra_body.chat_template_kwargs``, so generation and tokenize render the same prompt).
    """
    kwargs = dict(target.get("chat_template_kwargs") or {})
    kwargs.update(chat_template_kwargs or {})
    return load_target_tokens(
        target["path"],
        target.get("template") or "auto",
        trust_remote_code=bool(target.get("trust_remote_code", False)),
        chat_template_kwargs=kwargs,
    )


def prompt_think_state(target, prompt_ids: list[int]) -> str:
    """``"none" | "open" | "closed"``: whether the prompt ids already opened (or opened and closed) the think
    block after the last role/end-of-turn marker (the id-level twin of :meth:`TargetTokens.think_state`;
    ``target`` a :class:`TargetTokens` or None)."""
    if target is None or target.think_open_id is None:
        return "none"
    bound = set(target.role_marker_ids) | set(target.end_ids)
    o = c = -1
    for i in range(len(prompt_ids) - 1, -1, -1):
        t = prompt_ids[i]
        if t in bound:
            break
        if t == target.think_open_id and o < 0:
            o = i
        elif t == target.think_close_id and c < 0:
            c = i
    if o < 0:
        return "none"
    return "closed" if c > o else "open"


def split_output_ids(target, output_ids: list[int], state: str = "none") -> tuple[str | None, str]:
    """Split a completion's ids into ``(reasoning, content)`` text at the target's ``</think>`` id.

    Trailing end-of-turn ids are not text. For a reasoning target: the ids between ``<think>`` (or the prompt's
    open think block, ``state == "open"``) and ``</think>`` are the reasoning, the ids after it the content; no
    ``</think>`` in the output means everything is reasoning when the block was opened (truncated thinking), else
    everything is content. A non-reasoning target: all content, reasoning None. Decoded with special tokens kept
    and no space clean-up, so the tokenize stage's ``exact`` check sees the same text.
    """
    ids = list(output_ids)
    while ids and ids[-1] in target.end_ids:
        ids.pop()
    close, open_ = target.think_close_id, target.think_open_id
    r_ids: list[int] | None = None
    if target.fmt.reasoning and close is not None:
        if close in ids:
            j = ids.index(close)
            pre, ids = ids[:j], ids[j + 1:]
            r_ids = pre[pre.index(open_) + 1:] if open_ in pre else pre
        elif open_ in ids[:2] or state == "open":
            r_ids = ids[ids.index(open_) + 1:] if open_ in ids[:2] else ids
            ids = []
    if r_ids is None:
        return None, target.decode_batch([ids])[0] if ids else ""
    r, c = target.decode_batch([r_ids, ids])
    return r, c

