"""Build the tiny Kimi-style target model used by the embedded demo (rule ``tiny_target``).

The demo needs a *target model* that behaves like a real one at the interfaces the workflow touches, yet is built
locally in seconds from a seed, never downloaded:

* a **tokenizer** with Kimi K2's special tokens under their real names, and a **chat template** in the Kimi
  K2-Instruct (non-thinking) layout (``/work/shared/reference/formats.md`` §2.2);
* a random-weight **causal LM** (Llama architecture, fp32) that `transformers serve` can serve over the
  OpenAI-compatible HTTP API, and whose sampled completions are printable ASCII text that *ends its turn* with
  ``<|im_end|>`` after about ``mean_completion_tokens`` tokens;
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
    built-in Qwen response parser to ``qwen2``/``qwen3`` model types (anchored on ``<|im_start|>assistant\\n``)
    that leaks prompt text into ``content`` under a Kimi template; for ``llama`` it applies none and returns
    ``decode(generated_ids, skip_special_tokens=True)``, i.e. exactly the sampled text. The ``lm_head`` row of
    ``<|im_end|>`` is fitted (ridge least squares over typical completion states) so that the end-of-turn log-odds
    ``h @ w - logsumexp(allowed logits)`` is nearly the same constant ``k`` in every context, and ``k`` is solved by
    bisection so the expected completion length is ``mean_completion_tokens`` (lengths are then roughly geometric,
    with similar means across prompts; P(length > 256) is about 0.2 % at mean 40).

Generation config
    ``do_sample=True, temperature=1.0, top_k=0, top_p=1.0, eos_token_id=<|im_end|>``, ``min_new_tokens=2`` (no
    empty answers), and ``suppress_tokens`` =
    every id except printable ASCII (32..126), ``\\n`` (10) and ``<|im_end|>``. A sampled completion is therefore
    plain ASCII text followed by ``<|im_end|>`` (or cut at ``max_new_tokens``).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

__all__ = [
    "SPECIAL_TOKENS",
    "NON_SPECIAL_ADDED_TOKENS",
    "DEFAULT_SYSTEM_PROMPT",
    "CHAT_TEMPLATE",
    "RESPONSE_TEMPLATE",
    "ALLOWED_COMPLETION_BYTES",
    "build_tiny_target",
    "build_tokenizer",
    "bytes_to_unicode",
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

#: Byte values a completion may contain: ``\n`` and printable ASCII 32..126.
ALLOWED_COMPLETION_BYTES: tuple[int, ...] = (10, *range(32, 127))

#: Kimi K2-Instruct style (non-thinking) chat template; layout of formats.md §2.2, no newlines between turns.
#: Header ``<|im_{user|assistant|system}|>{name or role}<|im_middle|>``; tool/system/other roles use
#: ``<|im_system|>``; tool results ``## Return of {tool_call_id}\n{content}``; assistant tool calls as a
#: ``<|tool_calls_section_begin|>`` section carrying each call's ``id`` and JSON arguments (a string is emitted
#: as-is, a mapping via ``tojson``); the default system prompt is inserted when no message has role system.
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
    "{%- set ns = namespace(has_system=false) -%}"
    "{%- for message in messages -%}{%- if message['role'] == 'system' -%}{%- set ns.has_system = true -%}"
    "{%- endif -%}{%- endfor -%}"
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
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)

#: Response template for ``tokenizer.parse_response`` (and `transformers serve`'s parser if one is ever used).
#: Not saved on the tokenizer by default: with the llama architecture serve then returns the plain decode.
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
    *,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 8,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 8192,
    mean_completion_tokens: float = 40,
) -> dict:
    """Write the tiny Kimi-style target (tokenizer + random-weight Llama causal LM + generation config) to ``out_dir``.

    Deterministic in its arguments: the same arguments give the same token ids and bit-identical weights. Never
    downloads. Built in a temporary directory next to ``out_dir`` and renamed into place, so ``out_dir`` is either
    absent, the previous build, or complete (an existing ``out_dir`` is replaced).

    Args:
        out_dir: directory to create; loadable afterwards with ``AutoTokenizer``/``AutoModelForCausalLM``
            ``.from_pretrained(out_dir)`` and servable with ``transformers serve out_dir``.
        seed: seed of the weight initialization and of the calibration text.
        hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size, max_position_embeddings:
            Llama config values (``head_dim = hidden_size // num_heads``).
        mean_completion_tokens: target mean completion length in tokens (including ``<|im_end|>``); the
            ``<|im_end|>`` ``lm_head`` row is calibrated so the expected length on typical states is this.

    Returns:
        ``{"vocab_size": int, "special_token_ids": {name: id}, "eos_token_id": int, "pad_token_id": int,
        "num_layers": int, "hidden_size": int, "model_type": "llama", "end_of_turn_scale": float,
        "mean_p_end": float, "seed": int, "mean_completion_tokens": float}`` (``end_of_turn_scale`` is the
        calibrated end-of-turn log-odds ``k``; ``mean_p_end`` the achieved mean per-step end probability on the
        calibration states). The same dict is written to ``out_dir/tiny_target.json``.

    Raises:
        ValueError: on inconsistent sizes (``hidden_size`` not divisible by ``num_heads``, ``num_heads`` by
            ``num_kv_heads``) or ``mean_completion_tokens <= 1``.
    """
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError(
            f"tiny target: hidden_size ({hidden_size}) must be divisible by num_heads ({num_heads}) and "
            f"num_heads by num_kv_heads ({num_kv_heads})"
        )
    if not mean_completion_tokens > 1:
        raise ValueError(f"tiny target: mean_completion_tokens must be > 1, got {mean_completion_tokens}")

    out_dir = Path(out_dir)
    tok = build_tokenizer()
    vocab_size = len(tok)  # 272, already a multiple of 8
    ids = {name: tok.convert_tokens_to_ids(name) for name in SPECIAL_TOKENS}
    im_end = ids["<|im_end|>"]

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=ids["[BOS]"],
        eos_token_id=im_end,
        pad_token_id=ids["[PAD]"],
        dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.float32).eval()
        scale, mean_p = _calibrate_end_of_turn(model, tok, im_end, float(mean_completion_tokens), seed)

    allowed = set(ALLOWED_COMPLETION_BYTES) | {im_end}
    gen = GenerationConfig(
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        bos_token_id=ids["[BOS]"],
        eos_token_id=im_end,
        pad_token_id=ids["[PAD]"],
        suppress_tokens=[i for i in range(vocab_size) if i not in allowed],
        # no empty answers: the end-of-turn token is masked for the first sampled token (validation rejects
        # a completion that is nothing but the end-of-turn token as `empty_completion`)
        min_new_tokens=2,
    )
    model.generation_config = gen

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        facts = {
            "vocab_size": vocab_size,
            "special_token_ids": ids,
            "eos_token_id": im_end,
            "pad_token_id": ids["[PAD]"],
            "num_layers": num_layers,
            "hidden_size": hidden_size,
            "model_type": config.model_type,
            "end_of_turn_scale": scale,
            "mean_p_end": mean_p,
            "seed": seed,
            "mean_completion_tokens": mean_completion_tokens,
        }
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
    return facts


def _calibrate_end_of_turn(model, tok, im_end: int, mean_tokens: float, seed: int) -> tuple[float, float]:
    """Set ``lm_head.weight[im_end]`` so the expected completion length is ``mean_tokens`` in every context.

    Typical states: the final (post-norm) hidden states at the completion positions of :data:`_CALIBRATION_PROMPTS`
    (rendered with the chat template, generation prompt added) followed by ``6 * mean_tokens`` uniformly random
    allowed bytes (what this random model samples is close to uniform over them). The row is ``w = a + k * b`` with
    ``a``, ``b`` the ridge least-squares solutions of ``H a ~ other`` and ``H b ~ 1`` (``other`` = logsumexp of the
    allowed tokens' logits), so the end-of-turn log-odds ``H w - other`` is close to ``k`` everywhere. With per-step
    end probability ``p_t = sigmoid(h_t @ w - other_t)`` the expected length (incl. ``<|im_end|>``) of sequence j is
    ``sum_t prod_{s<t} (1 - p_s)``; ``k`` is solved by bisection so its mean over the prompts is ``mean_tokens``.
    ``k`` is rounded to 4 significant digits and the row to 1e-5 so the saved weights do not depend on float
    summation order (thread count). Returns ``(k, mean per-step P(end) on the calibration states)``.
    """
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    allowed = torch.tensor(ALLOWED_COMPLETION_BYTES)
    n = int(6 * mean_tokens)
    states = []
    with torch.no_grad():
        model.lm_head.weight[im_end].zero_()
        for msgs, tools in _CALIBRATION_PROMPTS:
            prompt_ids = tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=False)
            prompt_ids = tok.encode(prompt_ids, add_special_tokens=False)
            completion = allowed[torch.randint(len(allowed), (n,), generator=gen)]
            ids = torch.tensor(prompt_ids + completion.tolist()).unsqueeze(0)
            out = model.model(input_ids=ids)
            # the state at position p predicts token p+1: the last prompt position, then the completion ones
            states.append(out.last_hidden_state[0, len(prompt_ids) - 1 :])
        h = torch.stack(states).double()  # (prompts, n + 1, hidden)
        other = torch.logsumexp(h @ model.lm_head.weight[allowed].double().T, dim=-1)  # (prompts, n + 1)
        # the end-of-turn log-odds is h @ w - other; fit w = a + k * b so it is close to the constant k everywhere
        flat = h.reshape(-1, h.shape[-1])
        ridge = 1e-3 * torch.eye(flat.shape[-1], dtype=flat.dtype)
        gram = flat.T @ flat + ridge
        a_vec = torch.linalg.solve(gram, flat.T @ other.reshape(-1))
        b_vec = torch.linalg.solve(gram, flat.T @ torch.ones(flat.shape[0], dtype=flat.dtype))

        def expected_len(k: float) -> float:
            p_end = torch.sigmoid(h @ (a_vec + k * b_vec) - other)
            survive = torch.cumprod(1 - p_end, dim=-1)
            return (1 + survive[:, :-1].sum(-1)).mean().item()

        lo, hi = -1.0, 1.0
        while expected_len(lo) < mean_tokens:
            lo *= 2.0
            if lo < -1e6:  # pragma: no cover - cannot happen with a normed hidden state
                raise RuntimeError("tiny target: could not calibrate the end-of-turn logit")
        while expected_len(hi) > mean_tokens:
            hi *= 2.0
            if hi > 1e6:  # pragma: no cover
                raise RuntimeError("tiny target: could not calibrate the end-of-turn logit")
        for _ in range(100):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if expected_len(mid) > mean_tokens else (lo, mid)
        c = float(f"{(lo + hi) / 2:.4g}")
        row = torch.round((a_vec + c * b_vec) * 1e5) / 1e5
        model.lm_head.weight[im_end] = row.to(model.lm_head.weight.dtype)
        achieved = torch.sigmoid(h @ row - other).mean().item()
    return c, achieved


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
