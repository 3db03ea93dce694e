"""Build the tiny Kimi-style target model used by the embedded demo (rule ``tiny_target``).

The demo needs a *target model* that behaves like a real one at the interfaces the workflow touches, yet is built
locally in seconds from a seed, never downloaded:

* a **tokenizer** with Kimi K2's special tokens under their real names, and a **chat template** in the Kimi K2.5
  thinking layout that the ``kimi-k25`` completion family of :mod:`eagle3_data.templates` describes (the generation
  prompt ends in ``<think>``, or ``<think></think>`` with ``thinking=False``);
* a random-weight **causal LM** (Llama architecture, fp32) that `transformers serve` can serve over the
  OpenAI-compatible HTTP API, whose sampled completions are a *reasoning* text, ``</think>``, an *answer* text and
  ``<|im_end|>`` (about ``mean_reasoning_tokens`` and ``mean_completion_tokens`` tokens long), and which
  `transformers serve` returns split into ``reasoning_content`` and ``content`` (the tokenizer carries a
  ``response_template``);
* a ``generation_config.json`` that makes those sampled completions valid training data.

Tokenizer
    Byte-level BPE with **no merges**: ids ``0..255`` are the 256 single bytes (the GPT-2 ByteLevel alphabet, in byte
    order, so id ``b`` is byte ``b``), then the special tokens in :data:`SPECIAL_TOKENS` order (ids ``256..271``;
    272 is already a multiple of 8, so no ``<|reserved_token_N|>`` padding is needed). Without merges every
    character is one token, so ``encode(decode(ids)) == ids`` for any sequence of ASCII byte ids (and any valid
    UTF-8 byte sequence). Special tokens are added tokens, matched before pre-tokenization, so they stay atomic
    inside any string. As in Kimi's ``tokenizer_config.json`` the five tool-call section tokens are *not* flagged
    special (``decode(skip_special_tokens=True)`` keeps them); all others are.
    ``eos_token = <|im_end|>``, ``pad_token = [PAD]``, ``bos_token = [BOS]``, ``unk_token = [UNK]``; encoding never
    adds a BOS/EOS (no post-processor).

Chat template
    :data:`CHAT_TEMPLATE`, saved as ``chat_template.jinja`` by ``save_pretrained`` (transformers 5).

Model
    ``LlamaForCausalLM`` with untied embeddings. Llama is chosen over Qwen3 because `transformers serve` applies a
    built-in Qwen response parser to ``qwen2``/``qwen3`` model types; for ``llama`` it uses the tokenizer's own
    ``response_template`` (:data:`RESPONSE_TEMPLATE`). The weights are random except for a small grammar
    written into them, so that every sampled completion has the shape the Kimi K2.5 format requires:

    - :data:`STATE_DIMS` residual dimensions (the last ones) carry a one-hot *state* of the current token (see
      :func:`token_state`): set by the token embedding, written by no layer (those rows of every ``o_proj`` and
      ``down_proj`` are zero), so the final hidden state holds the state of the last token exactly;
    - the ``lm_head`` columns of those dimensions give every token not allowed after that state a large negative
      logit (:data:`NEXT` lists what may follow what): the reasoning uses :data:`REASONING_BYTES`, the answer
      :data:`CONTENT_BYTES` (disjoint, so the last token says which part the model is in), ``</think>`` and
      ``<|im_end|>`` only follow a non-space character and neither part starts with a space (`transformers
      serve` strips the ends of both parts), and after ``</think>`` only the answer may follow;
    - the ``</think>`` and ``<|im_end|>`` logits after a character are raised by a constant solved so the mean
      reasoning and answer lengths (end marker included) are ``mean_reasoning_tokens`` and
      ``mean_completion_tokens``; lengths are then roughly geometric.

Generation config
    ``do_sample=True, temperature=1.0, top_k=0, top_p=1.0, eos_token_id=<|im_end|>``, ``min_new_tokens=2``, and
    ``suppress_tokens`` = every id except :data:`ALLOWED_COMPLETION_BYTES`, ``</think>`` and ``<|im_end|>``.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .settings import TinyTargetSettings

__all__ = [
    "SPECIAL_TOKENS",
    "NON_SPECIAL_ADDED_TOKENS",
    "DEFAULT_SYSTEM_PROMPT",
    "CHAT_TEMPLATE",
    "RESPONSE_TEMPLATE",
    "REASONING_BYTES",
    "CONTENT_BYTES",
    "ALLOWED_COMPLETION_BYTES",
    "NEXT",
    "build_tiny_target",
    "build_tokenizer",
    "bytes_to_unicode",
    "token_state",
]

#: Kimi K2 special tokens by their real names, in the order they get ids 256, 257, ... in the tiny vocabulary.
SPECIAL_TOKENS: tuple[str, ...] = (
    "[BOS]",
    "[EOS]",
    "<|im_end|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_system|>",
    "<|im_middle|>",
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
    "<think>",
    "</think>",
    "[UNK]",
    "[PAD]",
)

#: Added tokens that Kimi's tokenizer_config flags ``special: false`` (atomic, but kept by skip_special_tokens).
NON_SPECIAL_ADDED_TOKENS: frozenset[str] = frozenset(
    {
        "<|tool_calls_section_begin|>",
        "<|tool_calls_section_end|>",
        "<|tool_call_begin|>",
        "<|tool_call_argument_begin|>",
        "<|tool_call_end|>",
    }
)

DEFAULT_SYSTEM_PROMPT = "You are Kimi, an AI assistant created by Moonshot AI."

#: Bytes of a sampled reasoning text: lowercase letters, ``\n`` (its only whitespace), ``,`` ``.`` ``-``.
REASONING_BYTES: tuple[int, ...] = (10, 44, 45, 46, *range(97, 123))
#: Bytes of a sampled answer: uppercase letters, digits, space (its only whitespace) and ``!`` ``(`` ``)`` ``:`` ``;``
#: ``?``. Disjoint from :data:`REASONING_BYTES`.
CONTENT_BYTES: tuple[int, ...] = (32, 33, 40, 41, *range(48, 60), 63, *range(65, 91))
#: Byte values a completion may contain (reasoning or answer).
ALLOWED_COMPLETION_BYTES: tuple[int, ...] = tuple(sorted(REASONING_BYTES + CONTENT_BYTES))

#: Token states (see :func:`token_state`) and what may follow each: a set of byte values and/or token names.
#: ``reasoning_start``: ``<think>``; ``answer_start``: ``</think>`` and every other token (the end of any prompt
#: that does not open a think block).
_R_CHARS = frozenset(b for b in REASONING_BYTES if b != 10)
_C_CHARS = frozenset(b for b in CONTENT_BYTES if b != 32)
NEXT: dict[str, frozenset] = {
    "reasoning_start": _R_CHARS,
    "reasoning_char": frozenset(REASONING_BYTES) | {"</think>"},
    "reasoning_space": _R_CHARS,
    "answer_start": _C_CHARS,
    "answer_char": frozenset(CONTENT_BYTES) | {"<|im_end|>"},
    "answer_space": _C_CHARS,
}
#: Residual dimensions holding the one-hot token state (the last ``len(NEXT)`` of the hidden size).
STATE_DIMS = len(NEXT)


def token_state(token: int | str) -> str:
    """The grammar state after ``token`` (a byte value or a special-token name): which :data:`NEXT` set applies."""
    if token == "<think>":
        return "reasoning_start"
    if token == 10:
        return "reasoning_space"
    if token in _R_CHARS:
        return "reasoning_char"
    if token == 32:
        return "answer_space"
    if token in _C_CHARS:
        return "answer_char"
    return "answer_start"


#: Kimi K2.5 style (thinking) chat template, no newlines between turns. Header
#: ``<|im_{user|assistant|system}|>{name or role}<|im_middle|>``; tool/system/other roles use ``<|im_system|>``; tool
#: results ``## Return of {tool_call_id}\n{content}``; assistant tool calls as a ``<|tool_calls_section_begin|>``
#: section carrying each call's ``id`` and JSON arguments (a string as-is, a mapping via ``tojson``); the default
#: system prompt when no message has role system. Assistant turns up to the last one without tool calls render an
#: empty think block (their reasoning is dropped), later ones ``<think>{reasoning_content}</think>``; the
#: generation prompt ends ``<think>`` (``thinking`` true or not given) or ``<think></think>`` (``thinking=False``).
CHAT_TEMPLATE = (
    "{%- macro render_content(content) -%}"
    "{%- if content is string -%}{{ content }}"
    "{%- elif content is not none -%}"
    "{%- for part in content -%}{%- if part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{%- if tools -%}"
    "<|im_system|>tool_declare<|im_middle|>{{ tools | tojson(separators=(',', ':')) }}<|im_end|>"
    "{%- endif -%}"
    "{%- set ns = namespace(has_system=false, last_plain=-1) -%}"
    "{%- for message in messages -%}{%- if message['role'] == 'system' -%}{%- set ns.has_system = true -%}"
    "{%- endif -%}{%- if message['role'] == 'assistant' and not message.get('tool_calls') -%}"
    "{%- set ns.last_plain = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- if not ns.has_system -%}"
    "<|im_system|>system<|im_middle|>" + DEFAULT_SYSTEM_PROMPT + "<|im_end|>"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- set role = message['role'] -%}"
    "{%- set label = message.get('name') or role -%}"
    "{%- if role == 'user' -%}<|im_user|>{{ label }}<|im_middle|>"
    "{%- elif role == 'assistant' -%}<|im_assistant|>{{ label }}<|im_middle|>"
    "{%- else -%}<|im_system|>{{ label }}<|im_middle|>"
    "{%- endif -%}"
    "{%- if role == 'assistant' -%}"
    "{%- if loop.index0 <= ns.last_plain -%}<think></think>"
    "{%- else -%}<think>{{ message.get('reasoning_content') or '' }}</think>{%- endif -%}"
    "{%- endif -%}"
    "{%- if role == 'tool' -%}"
    "## Return of {{ message.get('tool_call_id', '') }}\n{{ render_content(message.get('content')) }}"
    "{%- elif role == 'assistant' and message.get('tool_calls') -%}"
    "{{ render_content(message.get('content')) }}<|tool_calls_section_begin|>"
    "{%- for tool_call in message['tool_calls'] -%}"
    "{%- set fn = tool_call['function'] if tool_call.get('function') else tool_call -%}"
    "<|tool_call_begin|>{{ tool_call.get('id') or ('functions.' ~ fn['name'] ~ ':' ~ loop.index0) }}"
    "<|tool_call_argument_begin|>"
    "{%- if fn['arguments'] is string -%}{{ fn['arguments'] }}{%- else -%}{{ fn['arguments'] | tojson }}{%- endif -%}"
    "<|tool_call_end|>"
    "{%- endfor -%}"
    "<|tool_calls_section_end|>"
    "{%- else -%}"
    "{{ render_content(message.get('content')) }}"
    "{%- endif -%}"
    "<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if thinking is defined and not thinking -%}<think></think>{%- else -%}<think>{%- endif -%}"
    "{%- endif -%}"
)

#: Response template (``tokenizer.parse_response``), saved on the tokenizer: `transformers serve` splits a sampled
#: completion into ``reasoning_content`` and ``content`` with it (the prompt's open ``<think>`` is read from the
#: prefix). Both parts come back stripped of surrounding whitespace, so the model never samples any there.
RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_assistant|>assistant<|im_middle|>",
    "fields": {
        "reasoning_content": {"open": "<think>", "close": "</think>", "content": "text"},
        "content": {"close_pattern": r"(?:<\|im_end\|>)", "content": "text"},
    },
}

_WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}

#: (messages, tools) pairs whose completion states calibrate the end-of-turn logit.
_CALIBRATION_PROMPTS = (
    ([{"role": "user", "content": "Hello! Can you tell me a short story about a robot?"}], None),
    (
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is 2 + 2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "And times 3?"},
        ],
        None,
    ),
    ([{"role": "user", "content": "Write a Python function that reverses a string.\nKeep it short."}], None),
    (
        [
            {"role": "user", "content": "What is the weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "functions.get_weather:0",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny, 21 C"},
        ],
        [_WEATHER_TOOL],
    ),
    ([{"role": "user", "content": "List three colors."}], None),
)


def build_tokenizer():
    """Return the tiny byte-level tokenizer as a transformers fast tokenizer (no download, deterministic).

    Vocabulary: 256 byte tokens (id == byte value) + :data:`SPECIAL_TOKENS` (ids 256..271), 272 ids in all.
    The chat template is :data:`CHAT_TEMPLATE`; ``clean_up_tokenization_spaces=False`` so decoding never alters
    spaces (needed for the decode->encode round trip).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = bytes_to_unicode()
    vocab = {alphabet[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    # add one at a time so ids follow SPECIAL_TOKENS order exactly
    for name in SPECIAL_TOKENS:
        special = name not in NON_SPECIAL_ADDED_TOKENS
        added = AddedToken(name, single_word=False, lstrip=False, rstrip=False, normalized=False, special=special)
        if special:
            tok.add_special_tokens([added])
        else:
            tok.add_tokens([added])
    for i, name in enumerate(SPECIAL_TOKENS):
        got = tok.token_to_id(name)
        if got != 256 + i:  # pragma: no cover - guards a tokenizers behaviour change
            raise RuntimeError(f"special token {name!r} got id {got}, expected {256 + i}")

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="[BOS]",
        eos_token="<|im_end|>",
        unk_token="[UNK]",
        pad_token="[PAD]",
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=8192,
    )


def build_tiny_target(
    out_dir: str | os.PathLike,
    settings: "TinyTargetSettings",
) -> dict:
    """Write the tiny Kimi-style target (tokenizer + random-weight Llama causal LM + generation config) to ``out_dir``.

    Deterministic in its arguments: the same arguments give the same token ids and bit-identical weights. Never
    downloads. Built in a temporary directory next to ``out_dir`` and renamed into place, so ``out_dir`` is either
    absent, the previous build, or complete (an existing ``out_dir`` is replaced).

    Args:
        out_dir: directory to create; loadable afterwards with ``AutoTokenizer``/``AutoModelForCausalLM``
            ``.from_pretrained(out_dir)`` and servable with ``transformers serve out_dir``.
        settings: :class:`~eagle3_data.settings.TinyTargetSettings` (``target.tiny``), fields:
        seed: seed of the weight initialization and of the calibration text.
        hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size, max_position_embeddings:
            Llama config values (``head_dim = hidden_size // num_heads``); ``hidden_size`` must leave room for the
            :data:`STATE_DIMS` state dimensions (at least 2 x as many).
        mean_reasoning_tokens: mean sampled reasoning length in tokens, ``</think>`` included (> 2).
        mean_completion_tokens: mean sampled answer length in tokens, ``<|im_end|>`` included (> 2).

    Returns:
        ``{"vocab_size": int, "special_token_ids": {name: id}, "eos_token_id": int, "pad_token_id": int,
        "num_layers": int, "hidden_size": int, "model_type": "llama", "state_scale": float,
        "end_logits": {"</think>": float, "<|im_end|>": float}, "seed": int, "mean_reasoning_tokens": float,
        "mean_completion_tokens": float}`` (``state_scale``: the embedding value of the state dimensions;
        ``end_logits``: the solved logit offsets of the two end markers after a character). The same dict is
        written to ``out_dir/tiny_target.json``.

    Raises:
        ValueError: on inconsistent sizes (``hidden_size`` not divisible by ``num_heads``, ``num_heads`` by
            ``num_kv_heads``, or too small for the state dimensions) or a mean length ``<= 2``.
    """
    import torch
    from transformers import LlamaForCausalLM

    _check_sizes(settings)
    tok = build_tokenizer()
    ids = {name: tok.convert_tokens_to_ids(name) for name in SPECIAL_TOKENS}
    vocab_size = len(tok)  # 272, already a multiple of 8
    config = _llama_config(settings, vocab_size, ids)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(settings.seed)
        model = LlamaForCausalLM(config).to(torch.float32).eval()
        scale, end_logits = _write_grammar(
            model,
            tok,
            ids,
            float(settings.mean_reasoning_tokens),
            float(settings.mean_completion_tokens),
            settings.seed,
        )
    model.generation_config = _generation_config(vocab_size, ids)
    tok.response_template = RESPONSE_TEMPLATE
    facts = {
        "vocab_size": vocab_size,
        "special_token_ids": ids,
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["[PAD]"],
        "num_layers": settings.num_layers,
        "hidden_size": settings.hidden_size,
        "model_type": config.model_type,
        "state_scale": scale,
        "end_logits": end_logits,
        "seed": settings.seed,
        "mean_reasoning_tokens": settings.mean_reasoning_tokens,
        "mean_completion_tokens": settings.mean_completion_tokens,
    }
    _save_replacing(Path(out_dir), model, tok, facts)
    return facts


def _check_sizes(s: "TinyTargetSettings") -> None:
    """Raise ValueError on inconsistent sizes or a mean length ``<= 2`` (:func:`build_tiny_target`)."""
    hidden_size, num_heads, num_kv_heads = s.hidden_size, s.num_heads, s.num_kv_heads
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError(
            f"tiny target: hidden_size ({hidden_size}) must be divisible by num_heads ({num_heads}) and "
            f"num_heads by num_kv_heads ({num_kv_heads})"
        )
    if hidden_size < 2 * STATE_DIMS:
        raise ValueError(f"tiny target: hidden_size must be at least {2 * STATE_DIMS}, got {hidden_size}")
    for name, value in (
        ("mean_reasoning_tokens", s.mean_reasoning_tokens),
        ("mean_completion_tokens", s.mean_completion_tokens),
    ):
        if not value > 2:
            raise ValueError(f"tiny target: {name} must be > 2 (a character and the end marker), got {value}")


def _llama_config(s: "TinyTargetSettings", vocab_size: int, ids: dict):
    """The ``LlamaConfig`` of the tiny target (float32, untied embeddings, ``<|im_end|>`` as eos)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=s.hidden_size,
        intermediate_size=s.intermediate_size,
        num_hidden_layers=s.num_layers,
        num_attention_heads=s.num_heads,
        num_key_value_heads=s.num_kv_heads,
        head_dim=s.hidden_size // s.num_heads,
        max_position_embeddings=s.max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=ids["[BOS]"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["[PAD]"],
        dtype="float32",
    )


def _generation_config(vocab_size: int, ids: dict):
    """The sampling ``GenerationConfig``: plain sampling, every token but the completion bytes and the two end
    markers suppressed."""
    from transformers import GenerationConfig

    im_end = ids["<|im_end|>"]
    allowed = set(ALLOWED_COMPLETION_BYTES) | {im_end, ids["</think>"]}
    return GenerationConfig(
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        bos_token_id=ids["[BOS]"],
        eos_token_id=im_end,
        pad_token_id=ids["[PAD]"],
        suppress_tokens=[i for i in range(vocab_size) if i not in allowed],
        min_new_tokens=2,
    )


def _save_replacing(out_dir: Path, model, tok, facts: dict) -> None:
    """Save ``model``, ``tok`` and ``facts`` (``tiny_target.json``) in a temporary directory next to ``out_dir``
    and rename it into place, replacing an existing ``out_dir``."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / "tiny_target.json").write_text(json.dumps(facts, indent=2, sort_keys=True) + "\n")
        # mkdtemp makes a 0700 directory; give the result ordinary permissions
        tmp.chmod(0o755)
        for f in tmp.iterdir():
            f.chmod(0o644)
        if out_dir.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".old", dir=out_dir.parent))
            os.replace(out_dir, old / "x")
            os.replace(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


#: Logit penalty (in units of the normed state value) of a token not allowed after the current state.
_PENALTY = 12.0


def _stop_probability(mean_tokens: float, n_allowed: int, n_space: int) -> float:
    """Per-step end probability after a character that gives a part of mean length ``mean_tokens`` (end marker
    included), under the grammar: the first token is a character, after a character comes the end marker
    (probability ``p``) or one of ``n_allowed`` characters (``n_space`` of them whitespace, which a character
    must follow). Expected length ``2 + (1 - p)(1 + q) / p`` with ``q = n_space / n_allowed``."""
    q = n_space / n_allowed
    return (1 + q) / (mean_tokens - 1 + q)


def _write_grammar(model, tok, ids: dict, mean_reasoning: float, mean_answer: float, seed: int):
    """Write the state dimensions and the grammar into the random weights (see the module docstring).

    State dimension ``j`` (residual index ``H - STATE_DIMS + j``) of token ``t`` is ``scale`` when ``t``'s state is
    the ``j``-th key of :data:`NEXT`, else 0; no layer writes there. ``scale`` is 4 x the largest norm the rest of
    the residual reaches on calibration text, so after the final RMSNorm the state value is within ~3 % of
    ``sqrt(H)`` and the random part of the logits is small. The ``lm_head`` column of state ``j`` is ``-PENALTY``
    for tokens not in ``NEXT[j]``; the end markers' columns of the two ``*_char`` states hold the solved offset
    (rounded to 4 significant digits, so weights do not depend on float summation order). Returns
    ``(scale, {"</think>": offset, "<|im_end|>": offset})``.
    """
    import torch

    H = model.config.hidden_size
    states = list(NEXT)
    base = H - STATE_DIMS
    vocab = model.config.vocab_size
    name_of = {v: k for k, v in ids.items()}
    token_states = [token_state(name_of.get(i, i)) for i in range(vocab)]

    def token_id(t) -> int:
        return ids[t] if isinstance(t, str) else t

    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb[:, base:] = 0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[base:, :] = 0
            layer.mlp.down_proj.weight[base:, :] = 0

        gen = torch.Generator().manual_seed(seed + 1)
        samples = _calibration_sequences(tok, ids, gen)

        def rest_norm_max() -> float:
            seen = []
            hook = model.model.norm.register_forward_hook(lambda mod, args, out: seen.append(args[0][0]))
            try:
                for _, seq in samples:
                    model.model(input_ids=torch.tensor([seq]))
            finally:
                hook.remove()
            return max(x[:, :base].norm(dim=-1).max().item() for x in seen)  # the residual before the final norm

        scale = 1.0
        for _ in range(3):  # the layers see the normed residual, so the rest barely moves with the scale
            for i in range(vocab):
                emb[i, base:] = 0
                emb[i, base + states.index(token_states[i])] = scale
            scale = float(f"{4 * rest_norm_max():.4g}")
        for i in range(vocab):
            emb[i, base:] = 0
            emb[i, base + states.index(token_states[i])] = scale

        head = model.lm_head.weight
        head[:, base:] = 0
        for j, st in enumerate(states):
            allowed = {token_id(t) for t in NEXT[st]}
            for v in range(vocab):
                if v not in allowed:
                    head[v, base + j] = -_PENALTY

        # solve the end-marker offsets on the calibration states (final normed hidden states)
        offsets = {}
        for marker, st, mean in (
            ("</think>", "reasoning_char", mean_reasoning),
            ("<|im_end|>", "answer_char", mean_answer),
        ):
            chars = [b for b in NEXT[st] if not isinstance(b, str)]
            spaces = [b for b in chars if token_state(b).endswith("_space")]
            p = _stop_probability(mean, len(chars), len(spaces))
            h = []
            for n_prompt, seq in samples:
                out = model.model(input_ids=torch.tensor([seq])).last_hidden_state[0]
                keep = [k for k, t in enumerate(seq) if k >= n_prompt and token_states[t] == st]
                h.append(out[keep])
            h = torch.cat(h).double()
            logits = h @ head.double().T
            other = torch.logsumexp(logits[:, chars], dim=-1)
            raw = logits[:, ids[marker]]
            sv = h[:, base + states.index(st)]
            lo, hi = -50.0, 50.0
            for _ in range(100):
                mid = (lo + hi) / 2
                mean_p = torch.sigmoid(raw + mid * sv - other).mean().item()
                lo, hi = (mid, hi) if mean_p < p else (lo, mid)
            offsets[marker] = float(f"{(lo + hi) / 2:.4g}")
            head[ids[marker], base + states.index(st)] = offsets[marker]
    return scale, offsets


def _calibration_sequences(tok, ids: dict, gen) -> list[tuple[int, list[int]]]:
    """``(prompt length, ids)``: the prompts of :data:`_CALIBRATION_PROMPTS` (thinking on) followed by a
    grammatical random completion: reasoning characters, ``</think>``, answer characters, ``<|im_end|>`` (40
    characters each part)."""
    import torch

    def part(chars: tuple[int, ...], n: int) -> list[int]:
        nonspace = [b for b in chars if b not in (10, 32)]
        out = []
        for k in range(n):
            pool = nonspace if k in (0, n - 1) or (out and out[-1] in (10, 32)) else chars
            out.append(pool[int(torch.randint(len(pool), (1,), generator=gen))])
        return out

    seqs = []
    for msgs, tools in _CALIBRATION_PROMPTS:
        prompt = tok.encode(
            tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )
        seqs.append(
            (
                len(prompt),
                prompt + part(REASONING_BYTES, 40) + [ids["</think>"]] + part(CONTENT_BYTES, 40) + [ids["<|im_end|>"]],
            )
        )
    return seqs


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode map (the ByteLevel alphabet), keyed by byte value."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}
