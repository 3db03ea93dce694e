"""Regenerate ``resources/samples/pretokenized.jsonl``: a small "A-type" (pre-tokenized) dataset for the tiny target.

Dev script, not part of the workflow. Usage (from the repository root)::

    python resources/make_pretokenized_sample.py [--out resources/samples/pretokenized.jsonl] [--seed 0]

Format: JSON Lines, one object per row: ``{"id": str, "input_ids": [int, ...], "loss_mask": [0|1, ...]}``, token
ids of the tiny Kimi-style target (``eagle3_data.tiny_target.build_tokenizer()``, vocab size 272). A clean row is
the prompt rendered with the target's chat template (``add_generation_prompt=True``, thinking on: it ends in
``<think>``) followed by the completion in the Kimi K2.5 thinking format: a short reasoning text, ``</think>``, a
short printable ASCII answer and ``<|im_end|>``; ``loss_mask`` is 1 exactly on the completion tokens including
``<|im_end|>`` and 0 on the prompt. Output is deterministic in ``--seed``.

Rows 0..22 (ids ``pt-000`` .. ``pt-022``) are clean. Rows 23..29 are deliberately messy, as real files are; a
validator must reject each of them with a reason, never silently drop or accept them:

* ``pt-023``: ``loss_mask`` one element longer than ``input_ids`` (length mismatch);
* ``pt-024``: ``loss_mask`` three elements shorter than ``input_ids`` (length mismatch);
* ``pt-025``: empty ``input_ids`` (and empty ``loss_mask``);
* ``pt-026``: one completion id is 300, not below the vocabulary size 272 (id out of vocabulary);
* ``pt-027``: ``loss_mask`` all zeros (no supervised token);
* ``pt-028``: the completion does not end with ``<|im_end|>`` (truncated turn; mask still 1 on the completion);
* row 29: no ``"id"`` field at all (a loader must give it a content-hash id or reject it, but not crash).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from eagle3_data.files import write_text
from eagle3_data.tiny_target import build_tokenizer

N_CLEAN = 23

_PROMPTS = [
    [{"role": "user", "content": "Give me a haiku about autumn."}],
    [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Capital of France?"}],
    [
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And times 3?"},
    ],
    [{"role": "user", "content": "Write a Python function that reverses a string."}],
    [{"role": "user", "content": "Summarize: the cat sat on the mat.\nBe short."}],
]
_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
_TOOL_PROMPT = [
    {"role": "user", "content": "Weather in Oslo?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "functions.get_weather:0",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "rain, 7 C"},
]
_WORDS = "the a model draft token answer short text is of to and in weather rain sunny cat mat four twelve".split()


def _completion_text(rng: random.Random) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(2, 12))]
    text = " ".join(words).capitalize() + rng.choice([".", "!", "?", ".\nDone."])
    return text


def _reasoning_text(rng: random.Random) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 10))]
    return "the user asks " + " ".join(words) + rng.choice([".", ", so answer briefly.", ".\nkeep it short."])


def make_rows(seed: int = 0) -> list[dict]:
    """Return the 30 rows described in the module docstring (23 clean, then 7 messy), deterministic in ``seed``."""
    tok = build_tokenizer()
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    rng = random.Random(seed)
    rows = []
    for i in range(N_CLEAN + 7):
        if i % 6 == 5:
            msgs, tools = _TOOL_PROMPT, _TOOLS
        else:
            msgs, tools = _PROMPTS[i % 6], None
        prompt = tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=False)
        prompt_ids = tok.encode(prompt, add_special_tokens=False)
        completion = _reasoning_text(rng) + "</think>" + _completion_text(rng)
        completion_ids = tok.encode(completion, add_special_tokens=False) + [im_end]
        rows.append(
            {
                "id": f"pt-{i:03d}",
                "input_ids": prompt_ids + completion_ids,
                "loss_mask": [0] * len(prompt_ids) + [1] * len(completion_ids),
            }
        )
    # the messy tail
    rows[23]["loss_mask"] = rows[23]["loss_mask"] + [1]
    rows[24]["loss_mask"] = rows[24]["loss_mask"][:-3]
    rows[25]["input_ids"], rows[25]["loss_mask"] = [], []
    rows[26]["input_ids"][-3] = 300
    rows[27]["loss_mask"] = [0] * len(rows[27]["loss_mask"])
    rows[28]["input_ids"], rows[28]["loss_mask"] = rows[28]["input_ids"][:-1], rows[28]["loss_mask"][:-1]
    del rows[29]["id"]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(Path(__file__).parent / "samples" / "pretokenized.jsonl"))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rows = make_rows(args.seed)
    write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows), args.out)
    print(f"wrote {len(rows)} rows to {args.out}")


if __name__ == "__main__":
    main()
