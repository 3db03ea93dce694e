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
drops it everywhere (their templates under ``src/eagle3_data/testing/chat_templates/``; SpecForge issues #296 and PR #419 on the
"vanishing thought"). Where a template keeps the final turn's reasoning (Qwen3, GLM-4.5, a Kimi tool-calling turn,
K2.6 ``preserve_thinking``) the product's ids equal its render of the finished conversation; elsewhere they follow
SGLang's reasoning-parser convention (``tests/unit/test_real_vocab.py``).

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
| `qwen3-coder` | `C<\\|im_end\\|>` | `C` as emitted | rejected `content_filter` | whitespace-only `C`: `empty_answer`; any reasoning: `unexpected_reasoning` | `[C.strip()\\n\\n]<tool_call>\\n<function=n>\\n<parameter=k>\\nv\\n</parameter>\\n</function>\\n</tool_call><\\|im_end\\|>` | a think block: `reasoning_marker_leak` |
| `llama3` (3.1, 3.3) | `C<\\|eot_id\\|>` | `C` as emitted | rejected `content_filter` | whitespace-only `C`: `empty_answer` | `{"name": n, "parameters": a}<\\|eot_id\\|>` (one call per turn, else `tool_calls_unsupported`) | not split |
| `gpt-oss` | `<\\|channel\\|>analysis<\\|message\\|>R<\\|end\\|><\\|start\\|>assistant<\\|channel\\|>final<\\|message\\|>C<\\|return\\|>` | in R: `<\\|channel\\|>analysis<\\|message\\|>R`; in C: without `<\\|return\\|>` | rejected `content_filter` | rejected `empty_answer` | `…R<\\|end\\|><\\|start\\|>assistant<\\|channel\\|>commentary to=functions.n <\\|constrain\\|>json<\\|message\\|>a<\\|call\\|>` (one call: generation stops at `<\\|call\\|>`) | not split; no reasoning at all: `missing_reasoning` |
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

# The machinery lives in modules named for what they do; this module keeps the table above and every name it
# used to define, so ``from eagle3_data.templates.core import X`` still works.

from __future__ import annotations

from .formats import (  # noqa: F401
    CompletionFormat,
    DEEPSEEK_R1_NO_TOOLS,
    FORMATS,
    KIMI_ROLE_MARKERS,
    KIMI_TOOL_TOKENS,
    LAYOUT_WRITERS,
    TOOL_WRITERS,
    TemplateError,
    completion_format,
    register,
)
from .replies import (  # noqa: F401
    FINISH_ALIASES,
    FINISH_REASONS,
    KIMI_CALL_ID,
    args_mapping,
    args_text,
    count_tool_calls,
    empty_think_block,
    normalize_finish_reason,
    normalize_ids,
    request_messages,
    rewrite_kimi_tool_call_ids,
    split_reasoning_from_content,
    thinking_enabled,
)
from .target import (  # noqa: F401
    TargetTokens,
    merge_segments,
)
from .shipped import (  # noqa: F401
    AS_FILE_CLASSES,
    PROBE_TEXT,
    as_shipped,
)
from .loading import (  # noqa: F401
    load_target_tokens,
    target_tokens,
)
from .think_state import (  # noqa: F401
    prompt_think_state,
    split_output_ids,
)
