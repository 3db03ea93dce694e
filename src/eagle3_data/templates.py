"""Target chat templates: prompt rendering with the target's own template and the exact completion format.

The training sequence of a sample is ``prompt_ids + completion_ids`` where

- ``prompt_ids`` come from the target tokenizer's own chat template with ``add_generation_prompt=True`` (tools
  passed through, ``target.chat_template_kwargs`` such as ``thinking`` / ``enable_thinking`` forwarded), so template
  quirks such as Kimi's default system prompt or the history-reasoning rules of Kimi/Qwen3/GLM are honoured by the
  template itself, never re-implemented;
- ``completion_ids`` are the tokens the target emits after that prompt, built from the response text in the
  target family's completion format (think block, content, tool-call section, end-of-turn token).

Rendering the *finished* conversation instead is wrong for reasoning targets: Kimi K2-Thinking/K2.5 render the
final answer with an empty ``<think></think>``, Qwen3 and GLM drop reasoning before the last user turn
(the published chat templates of those models).

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
deepseek-r1      ``<think>`` reasoning ``</think>`` content (prompt usually ends ``<think>\\n``)     ``<｜end▁of▁sentence｜>``
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
    extra: dict = field(default_factory=dict)


KIMI_ROLE_MARKERS = ("<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>")
KIMI_TOOL_TOKENS = (
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
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
    "deepseek-r1": CompletionFormat("deepseek-r1", "<｜end▁of▁sentence｜>", "<think>", "</think>", True, "plain",
                                    "none", ("<｜User｜>", "<｜Assistant｜>")),
    "generic": CompletionFormat("generic", None, None, None, None, "plain", "none", (), generic=True),
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
    """Token ids from whatever ``apply_chat_template(tokenize=True)`` or a tokenizer call returned, as ``list[int]``.

    transformers 5 may return a ``BatchEncoding``/dict (``len()`` of it is the number of keys, not tokens: a bug
    once seen in NVIDIA Model-Optimizer's data preparation), a torch/numpy tensor of shape ``(n,)`` or ``(1, n)``, a nested
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
        ``raise_exception`` on bad role order (one bad row must not kill the stage).
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
        holds); ``prior_tool_calls`` numbers Kimi call ids; ``truncated`` (``finish_reason == "length"``) leaves out
        the end-of-turn token the target never emitted. Raises :class:`TemplateError` with reason
        ``unexpected_reasoning`` (reasoning for a non-reasoning target or a prompt that closed the think block),
        ``bad_tool_call`` or ``template_mismatch``.
        """
        f = self.fmt
        r = reasoning or ""
        c = content or ""
        state, trailing = self.think_state(prompt_text) if f.reasoning else ("none", "")
        segs: list[tuple[str, bool]] = []
        if f.reasoning:
            if state == "closed" and r.strip():
                raise TemplateError("response has reasoning but the prompt closed the think block (thinking off)",
                                    "unexpected_reasoning")
            if f.layout == "qwen":
                segs += [(f.think_open, True), ("\n" + r.strip("\n") + "\n", False), (f.think_close, True),
                         ("\n\n" + c.lstrip("\n"), False)]
            elif f.layout == "glm":
                segs += [("\n", False), (f.think_open, True), (r.strip(), False), (f.think_close, True),
                         (("\n" + c.strip()) if c.strip() else "", False)]
            else:
                segs += [(f.think_open, True), (r, False), (f.think_close, True), (c, False)]
        else:
            if r.strip():
                raise TemplateError(f"response has reasoning but target family {f.name!r} does not reason",
                                    "unexpected_reasoning")
            segs.append((c, False))
        if tool_calls:
            segs += self._tool_segments(tool_calls, c, prior_tool_calls)
        if not truncated:
            segs.append((self.tool_eot_name if tool_calls else self.eot_name, True))
        if state != "none":
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
    """Load the target tokenizer from a local directory and bind it to a completion format.

    ``trust_remote_code`` lets tokenizers that ship their own code load (Kimi's tiktoken-based
    ``tokenization_kimi.py``); never set implicitly. Raises :class:`TemplateError` if the directory has no loadable
    tokenizer (the message says when ``target.trust_remote_code: true`` is needed) or no chat template.
    """
    from transformers import AutoTokenizer

    fmt = completion_format(template)
    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as exc:
        hint = ""
        if not trust_remote_code and ("trust_remote_code" in str(exc) or "custom code" in str(exc)):
            hint = " (this tokenizer ships its own code: set target.trust_remote_code: true)"
        raise TemplateError(f"{path}: cannot load the target tokenizer: {exc}{hint}") from exc
    if not getattr(tok, "chat_template", None):
        raise TemplateError(f"{path}: the target tokenizer has no chat template")
    return TargetTokens(tok, fmt, chat_template_kwargs)


def target_tokens(target: dict, chat_template_kwargs: dict | None = None) -> TargetTokens:
    """:func:`load_target_tokens` from the config ``target`` slice (path, template, trust_remote_code,
    chat_template_kwargs); ``chat_template_kwargs`` given here update the target's (a dataset's
    ``generation.extra_body.chat_template_kwargs``, so generation and tokenize render the same prompt).
    """
    kwargs = dict(target.get("chat_template_kwargs") or {})
    kwargs.update(chat_template_kwargs or {})
    return load_target_tokens(
        target["path"],
        target.get("template", "generic"),
        trust_remote_code=bool(target.get("trust_remote_code", False)),
        chat_template_kwargs=kwargs,
    )
