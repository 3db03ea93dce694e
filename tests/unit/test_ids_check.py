"""ids_check on exact ids (eagle3_data.ids_check.resplit_tail): a reply whose ids a server returned may split its
text into other tokens than the tokenizer would; it is the render when its prompt ids are the render's and its ids
decode to the start of the render's text. Real Qwen3 vocabulary, Qwen3-Coder's chat template."""

from __future__ import annotations

import pytest

from eagle3_data.ids_check import IdsMismatch, finished_render_ids, render_tail, resplit_tail
from eagle3_data.testing.tokenizer_fixtures import qwen3_real

MESSAGES = [{"role": "user", "content": "Say something about tokenizers."}]
REPLY = "Tokenizers split text into pieces."


@pytest.fixture(scope="module")
def case():
    tok = qwen3_real("qwen3-coder")  # ChatML; a finished turn is rendered as it was generated
    finished = finished_render_ids(tok, MESSAGES, {"role": "assistant", "content": REPLY})
    prompt = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    canonical = tok.encode(REPLY, add_special_tokens=False)
    # the engine's own split: the reply's longest token spelt one character a token, where the tokenizer merges them
    k = max(range(len(canonical)), key=lambda j: len(tok.decode([canonical[j]])))
    chars = [i for c in tok.decode([canonical[k]]) for i in tok.encode(c, add_special_tokens=False)]
    resplit = canonical[:k] + chars + canonical[k + 1 :]
    assert resplit != canonical and tok.decode(resplit) == tok.decode(canonical) == REPLY
    return tok, finished, prompt, resplit + [tok.convert_tokens_to_ids("<|im_end|>")]


def test_a_resplit_reply_is_the_render_with_the_same_tail(case):
    tok, finished, prompt, reply = case
    row = {"ids_source": "exact", "num_prompt_tokens": len(prompt), "input_ids": prompt + reply}
    with pytest.raises(IdsMismatch):
        render_tail(row["input_ids"], finished)
    assert resplit_tail(tok, row, finished) == "\n"  # what the render writes after <|im_end|>


def test_reconstructed_ids_or_another_prompt_or_other_text_are_not(case):
    tok, finished, prompt, reply = case
    row = {"ids_source": "reconstructed", "num_prompt_tokens": len(prompt), "input_ids": prompt + reply}
    assert resplit_tail(tok, row, finished) is None  # re-encoded ids must be the canonical ones
    other_prompt = [prompt[0], prompt[1] + 1] + prompt[2:]
    row = {"ids_source": "exact", "num_prompt_tokens": len(prompt), "input_ids": other_prompt + reply}
    assert resplit_tail(tok, row, finished) is None
    other_text = reply[:-2] + tok.encode("!") + reply[-1:]
    row = {"ids_source": "exact", "num_prompt_tokens": len(prompt), "input_ids": prompt + other_text}
    assert resplit_tail(tok, row, finished) is None
