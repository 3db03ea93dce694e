"""Many synthetic conversations per family through tokenize + validate, each row checked against its oracle;
optionally what SpecForge's own preprocessing gives on the same rows.

Conversations (seeded): single turns, multi-turn histories (with or without a system message), unicode, a tool
call, an answer after tool results and empty think blocks, on the real vocabularies of ``tests/unit/test_families.py``.
Oracles: the target's own chat template rendering the finished conversation (gpt-oss also: ``openai-harmony``'s
render / parse of the completion; DeepSeek-V3.1 thinking: SGLang's reasoning-parser convention, the template drops
the final reasoning). ``tests/unit/test_families.py`` runs 60 per family; by hand::

    python -m eagle3_data.testing.family_rows 400 [--specforge PATH_TO_A_SPECFORGE_CHECKOUT]

prints one JSON line per family: ``tried``, ``exact``, ``differs``, ``rejected`` (by reason) and, with
``--specforge`` (sgl-project/SpecForge: its ``specforge/data/parse.py`` and ``template.py`` are loaded from the
checkout), how its ``gpt-oss`` / ``deepseek-v3`` preprocessing differs on each kind of row.
"""

from __future__ import annotations

import json
import random
import sys
import warnings
from collections import Counter
from pathlib import Path

from eagle3_data.templates import TargetTokens, completion_format
from eagle3_data.testing import tokenizer_fixtures as F
from eagle3_data.testing.rows import row
from eagle3_data.tokens import tokenize_rows
from eagle3_data.validate import Context, validate_rows

rng = random.Random(0)
WORDS = (
    "the",
    "user",
    "asks",
    "about",
    "Paris",
    "weather",
    "東京",
    "café",
    "🚀",
    "2+2",
    "= 4",
    "so",
    "answer",
    "is",
    "x**2",
    "def",
    "f(x):",
    "return",
    "«bitte»",
    "—",
    "42",
    "ok",
    "Let",
    "me",
    "think",
    "first",
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def text(n, nl=True):
    out = []
    for _ in range(rng.randint(1, n)):
        out.append(rng.choice(WORDS))
        if nl and rng.random() < 0.1:
            out.append("\n")
    return " ".join(out).replace(" \n ", "\n").strip() or "ok"


def call(i):
    return {
        "id": f"call_{i}",
        "type": "function",
        "function": {
            "name": "get_weather",
            "arguments": json.dumps({"city": rng.choice(["Paris", "Rome", "東京"])}, ensure_ascii=False),
        },
    }


def conversation(kind, thinking):
    msgs = []
    if rng.random() < 0.3:
        msgs.append({"role": "system", "content": "Be brief."})
    for _ in range(rng.randint(0, 2) if kind != "single" else 0):
        msgs += [{"role": "user", "content": text(8)}, {"role": "assistant", "content": text(8)}]
    msgs.append({"role": "user", "content": text(10)})
    tools = None
    r = text(20) if thinking else None
    if kind == "empty" and thinking:
        r = rng.choice(["", "\n\n"])
    reply = {"reasoning": r, "content": text(12)}
    if kind == "tool_call":
        tools = [WEATHER]
        reply = {"reasoning": r, "content": "", "tool_calls": [call(0)]}
    if kind == "tool_result":
        tools = [WEATHER]
        c = call(0)
        msgs += [
            {"role": "assistant", "content": "", "tool_calls": [c]},
            {"role": "tool", "tool_call_id": c["id"], "content": "sunny"},
        ]
    return msgs, tools, reply


def final_msg(reply, field="reasoning_content"):
    m = {"role": "assistant", "content": reply.get("content") or ""}
    if reply.get("reasoning") is not None:
        m[field] = reply["reasoning"]
    if reply.get("tool_calls"):
        m["tool_calls"] = reply["tool_calls"]
    return m


def run(name, tt, kinds, thinking, oracle, specforge=None, n=60):
    """``n`` conversations of ``kinds`` (cycled) through tokenize + validate; counts of exact / differing rows
    (``oracle``), rejections by reason and, with ``specforge``, what SpecForge's preprocessing gives on them."""
    rng.seed(name)
    stats = Counter()
    reasons = Counter()
    sf = Counter()
    for i in range(n):
        kind = kinds[i % len(kinds)]
        msgs, tools, reply = conversation(kind, thinking)
        (out,) = tokenize_rows([row(msgs, tools=tools, **reply)], tt)
        if out["reject_reason"] is None:
            (v,) = validate_rows([out], Context(tt))
            if v is not None:
                out = {**out, "reject_reason": v[0]}
        stats["tried"] += 1
        if out["reject_reason"]:
            reasons[out["reject_reason"]] += 1
            continue
        ok = oracle(tt, msgs, tools, reply, out)
        stats["exact" if ok else "differs"] += 1
        if specforge is not None:
            sf[kind + ": " + specforge(tt, msgs, tools, reply, out)] += 1
    return {"family": name, **stats, "rejected": dict(reasons), **({"specforge": dict(sf)} if specforge else {})}


def render_ids(tt, msgs, tools, reply, field="reasoning_content"):
    return tt.encode_texts([tt.render(msgs + [final_msg(reply, field)], tools, False)])[0]


# ---------------------------------------------------------------- oracles
def oss_oracle(tt, msgs, tools, reply, out):
    from openai_harmony import Conversation, Message, RenderConversationConfig, Role

    enc = F.harmony_encoding()
    p = out["num_prompt_tokens"]
    comp = out["input_ids"][p:]
    parsed = enc.parse_messages_from_completion_tokens(comp, Role.ASSISTANT)
    if reply.get("tool_calls"):
        fn = reply["tool_calls"][0]["function"]
        got = [(m.channel, m.recipient, m.content[0].text) for m in parsed]
        return got == [
            ("analysis", None, reply["reasoning"]),
            ("commentary", "functions." + fn["name"], fn["arguments"]),
        ]
    M = Message.from_role_and_content
    want = enc.render_conversation_for_training(
        Conversation.from_messages(
            [
                M(Role.ASSISTANT, reply["reasoning"]).with_channel("analysis"),
                M(Role.ASSISTANT, reply["content"]).with_channel("final"),
            ]
        ),
        RenderConversationConfig(auto_drop_analysis=False),
    )
    want = want[want.index(200006) + 2 :]  # less the leading <|start|>assistant
    return render_ids(tt, msgs, tools, reply, "thinking") == out["input_ids"] and comp == want


def v31_oracle(tt, msgs, tools, reply, out):
    p = out["num_prompt_tokens"]
    if tt.kwargs.get("thinking") and reply.get("reasoning") is not None and not msgs[-1]["role"] == "tool":
        want = reply["reasoning"] + "</think>" + (reply["content"] or "")
        if reply.get("tool_calls"):
            fn = reply["tool_calls"][0]["function"]
            want += (
                "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>"
                + fn["name"]
                + "<｜tool▁sep｜>"
                + fn["arguments"]
                + "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
            )
        return out["input_ids"][p:] == tt.encode_texts([want + "<｜end▁of▁sentence｜>"])[0] and out["input_ids"][
            :p
        ] == tt.prompt_ids(msgs, tools)
    return render_ids(tt, msgs, tools, reply) == out["input_ids"]


def template_oracle(tt, msgs, tools, reply, out):
    return render_ids(tt, msgs, tools, reply) == out["input_ids"]


def template_nl_oracle(tt, msgs, tools, reply, out):  # Qwen templates end a turn "<|im_end|>\n"
    return render_ids(tt, msgs, tools, reply) == out["input_ids"] + tt.encode_texts(["\n"])[0]


# ---------------------------------------------------------------- SpecForge (optional)
def load_specforge(path):
    """SpecForge's ``specforge/data/{parse,template}.py`` from checkout ``path`` as package ``specforge_data``."""
    import importlib.util
    import types

    pkg = types.ModuleType("specforge_data")
    pkg.__path__ = [str(Path(path) / "specforge" / "data")]
    sys.modules["specforge_data"] = pkg
    mods = {}
    for name in ("template", "parse"):
        spec = importlib.util.spec_from_file_location(
            f"specforge_data.{name}", Path(path) / "specforge" / "data" / f"{name}.py"
        )
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        mods[name] = mod
    return mods["parse"], mods["template"].TEMPLATE_REGISTRY


def oss_specforge(parse, registry):
    hp = parse.HarmonyParser(F.gpt_oss_real(), registry.get("gpt-oss"))

    def compare(tt, msgs, tools, reply, out):
        if reply.get("tool_calls") or any(m.get("tool_calls") or m["role"] == "tool" for m in msgs):
            return "no tool-call role"
        regen = "accepted"
        try:  # the conversation as SpecForge's regeneration script writes it (role assistant + reasoning_content)
            hp.parse(msgs + [final_msg(reply)], 1 << 20)
        except ValueError as exc:
            regen = str(exc)
        conv = [
            {"role": {"assistant": "assistant_final"}.get(m["role"], m["role"]), "content": m["content"]} for m in msgs
        ]
        conv += [
            {"role": "assistant_analysis", "content": reply["reasoning"]},
            {"role": "assistant_final", "content": reply["content"]},
        ]
        ids, mask = (x.tolist() for x in hp.parse(conv, 1 << 20))
        p = out["num_prompt_tokens"]
        sup = [i for i, m in zip(ids, mask) if m]
        ours = out["input_ids"][p:]
        tag = f"its own rows: {regen}; custom roles: "
        if ids == out["input_ids"] and sup == ours:
            return tag + "exact"
        if sup[-1] == 200007 and ours[-1] == 200002:
            return (
                tag
                + "ends <|end|> not <|return|>"
                + (", prompt differs" if ids[: len(ids) - len(sup)] != out["input_ids"][:p] else "")
            )
        return tag + "differs"

    return compare


def v31_specforge(parse, registry):
    gp = parse.GeneralParser(F.deepseek_v31(), registry.get("deepseek-v3"))

    def compare(tt, msgs, tools, reply, out):
        ids, mask = (x.tolist() for x in gp.parse(msgs + [final_msg(reply)], 1 << 20, tool=tools or [], **tt.kwargs))
        ours = out["input_ids"][out["num_prompt_tokens"] :]
        sup = [i for i, m in zip(ids, mask) if m]
        if ids == out["input_ids"] and sup == ours:
            return "exact"
        tags = []
        if (reply.get("reasoning") or "").strip() and reply["reasoning"].strip() not in tt.decode_batch([sup])[0]:
            tags.append("reasoning dropped")
        text = tt.tok.decode(ids, skip_special_tokens=False)
        if msgs[0]["role"] != "system" and "You are a helpful assistant." in text:
            tags.append("system prompt injected")
        if reply.get("tool_calls") and "<｜tool▁calls▁begin｜>" not in text.split("<｜User｜>")[-1]:
            tags.append("tool call not rendered")
        if len(sup) > len(ours) and sup[-len(ours) :] == ours:
            extra = sup[: -len(ours)]
            tags.append(
                "supervises the prompt's </think>"
                if extra == [tt.think_close_id]
                else "history assistant turns supervised too"
            )
        elif sup[-len(ours) :] != ours:
            tags.append("final turn's ids differ")
        return ", ".join(tags) or "differs"

    return compare


# ---------------------------------------------------------------- the families
def families():
    """``(name, target, kinds, thinking, oracle, specforge builder or None)`` per family."""
    return [
        (
            "gpt-oss",
            TargetTokens(F.gpt_oss_real(), completion_format("gpt-oss")),
            ["single", "multi", "tool_call", "tool_result", "empty"],
            True,
            oss_oracle,
            oss_specforge,
        ),
        (
            "deepseek-v3.1 thinking",
            TargetTokens(F.deepseek_v31(), completion_format("deepseek-v3.1"), {"thinking": True}),
            ["single", "multi", "empty", "tool_call"],
            True,
            v31_oracle,
            v31_specforge,
        ),
        (
            "deepseek-v3.1 non-thinking",
            TargetTokens(F.deepseek_v31(), completion_format("deepseek-v3.1")),
            ["single", "multi", "tool_call", "tool_result"],
            False,
            v31_oracle,
            v31_specforge,
        ),
        (
            "qwen3-coder",
            TargetTokens(F.qwen3_real("qwen3-coder"), completion_format("qwen3-coder")),
            ["single", "multi", "tool_call", "tool_result"],
            False,
            template_nl_oracle,
            None,
        ),
        (
            "llama3 (stand-in vocabulary)",
            TargetTokens(F.llama3_standin(), completion_format("llama3")),
            ["single", "multi", "tool_call", "tool_result"],
            False,
            template_oracle,
            None,
        ),
        (
            "qwen3 empty think",
            TargetTokens(F.qwen3_real(), completion_format("qwen3")),
            ["empty"],
            True,
            template_nl_oracle,
            None,
        ),
    ]


def main(argv):
    warnings.filterwarnings("ignore")
    n = int(argv[0]) if argv and argv[0].isdigit() else 200
    sf = argv[argv.index("--specforge") + 1] if "--specforge" in argv else None
    parse, registry = load_specforge(sf) if sf else (None, None)
    for name, tt, kinds, thinking, oracle, spec in families():
        compare = spec(parse, registry) if (spec and sf) else None
        print(json.dumps(run(name, tt, kinds, thinking, oracle, compare, n), ensure_ascii=False))


if __name__ == "__main__":
    main(sys.argv[1:])
