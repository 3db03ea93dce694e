"""Synthetic source files for the rehearsal, in each dataset's real public format, written fast.

Texts are slices of one deterministic ASCII corpus (so the tiny byte-level target tokenizes 1 char = 1 token and
every character count below is a token count); lengths are lognormal around realistic per-dataset means.
Parquet via pyarrow, JSON / JSONL via DuckDB ``COPY ... (FORMAT JSON)`` from Arrow tables (no Python-level
JSON encoding of the big files). Each B source also holds a few unusable rows (an empty or assistant-first
conversation), which normalize rejects with a reason, so the seed's sample counts come out of normalize.

Public layouts (the datasets' own files):
glaive-function-calling-v2 JSON array ``{system, chat}``; nvidia/OpenCodeInstruct parquet ``{id, input, output,
domain, generation_algorithm, llm_judgement, unit_tests, tests_execution_status, average_test_score}``;
Magicoder OSS-Instruct JSONL ``{lang, raw_index, index, seed, openai_fingerprint, problem, solution}``;
open-r1/Mixture-of-Thoughts parquet ``{messages: [{content, role}], num_tokens, source}``; OpenThoughts-114k
parquet ``{system, conversations: [{from, value}]}``; ultrachat_200k parquet ``{prompt, prompt_id, messages}``;
ShareGPT JSON array ``{id, conversations: [{from, value}]}``; nebius/SWE-agent-trajectories parquet
``{instance_id, model_name, target, trajectory: [{cutoff_date, mask, role, system_prompt, text}], exit_status,
generated_patch, eval_logs}``; pre-tokenized JSONL ``{sample_id, input_ids, loss_mask}``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from eagle3_data.testing.rehearsal_server import CORPUS  # same ASCII corpus as the server's replies

CB = np.frombuffer(CORPUS.encode("ascii"), dtype=np.uint8)


class Texts:
    """Random ASCII text slices with lognormal lengths (characters = tiny-target tokens)."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.r = random.Random(seed)

    def lengths(self, n: int, mean: float, sigma: float = 0.7, lo: int = 8, hi: int = 200_000) -> np.ndarray:
        mu = np.log(mean) - sigma * sigma / 2
        return np.clip(np.rint(self.rng.lognormal(mu, sigma, n)), lo, hi).astype(np.int64)

    def text(self, n: int) -> str:
        n = int(n)
        off = self.r.randrange(len(CORPUS) - 1)
        t = CORPUS[off : off + n]
        while len(t) < n:
            t += CORPUS[: n - len(t)]
        return t.strip() or "x"

    def many(self, n: int, mean: float, sigma: float = 0.7, lo: int = 8) -> list[str]:
        return [self.text(k) for k in self.lengths(n, mean, sigma, lo)]

    def hexid(self, k: int) -> str:
        return "%0*x" % (k, self.r.getrandbits(4 * k))


def _copy_json(table: pa.Table, path: Path, array: bool) -> None:
    con = duckdb.connect()
    con.register("t", table)
    opt = "FORMAT JSON, ARRAY true" if array else "FORMAT JSON"
    con.execute(f"COPY (SELECT * FROM t) TO '{path}' ({opt})")
    con.close()


def _bad_idx(m: int, bad: int) -> set[int]:
    """``bad`` distinct row indices spread over ``m`` rows."""
    step = max(1, m // max(1, bad))
    return {(j * step + 1) % m for j in range(bad)} if m else set()


def _msgs_type(a: str, b: str) -> pa.DataType:
    return pa.list_(pa.struct([(a, pa.string()), (b, pa.string())]))


# ---------------------------------------------------------------------------------------------------------------
# B-type sources: write(path, n_good, n_bad, seed) -> number of rows written


def write_glaive(path: Path, n: int, bad: int, seed: int) -> int:
    tx = Texts(seed)
    systems, chats = [], []
    for i in range(n):
        if tx.r.random() < 0.8:
            specs = []
            for k in range(tx.r.choice((1, 1, 2))):
                specs.append(
                    {
                        "name": f"get_{tx.text(12).split()[0].lower() or 'item'}_{k}",
                        "description": tx.text(tx.r.randint(40, 120)),
                        "parameters": {
                            "type": "object",
                            "properties": {
                                "query": {"type": "string", "description": tx.text(30)},
                                "limit": {"type": "integer", "description": "Maximum number of results"},
                            },
                            "required": ["query"],
                        },
                    }
                )
            system = (
                "SYSTEM: You are a helpful assistant with access to the following functions. Use them if "
                "required -\n" + "\n".join(json.dumps(s, indent=4) for s in specs)
            )
            name = specs[0]["name"]
            q = tx.text(tx.lengths(1, 140)[0])
            args = json.dumps({"query": tx.text(24), "limit": tx.r.randint(1, 10)})
            chat = (
                f'USER: {q}\n\n\nASSISTANT: <functioncall> {{"name": "{name}", "arguments": \'{args}\'}} '
                f"<|endoftext|>\n\n\nFUNCTION RESPONSE: {json.dumps({'results': [tx.text(60), tx.text(60)]})}"
                f"\n\n\nASSISTANT: {tx.text(tx.lengths(1, 260)[0])} <|endoftext|>\n\n\n"
            )
            if tx.r.random() < 0.3:
                chat += (
                    f"USER: {tx.text(tx.lengths(1, 90)[0])}\n\n\n"
                    f"ASSISTANT: {tx.text(tx.lengths(1, 220)[0])} <|endoftext|>\n\n\n"
                )
        else:
            system = "SYSTEM: You are a helpful assistant, with no access to external functions.\n\n\n"
            chat = f"USER: {tx.text(tx.lengths(1, 160)[0])}\n\n\nASSISTANT: {tx.text(tx.lengths(1, 400)[0])} <|endoftext|>\n\n\n"
        systems.append(system)
        chats.append(chat)
    for j in range(bad):  # a conversation that starts with the assistant: normalize rejects it
        systems.insert(j * 997 % (len(systems) + 1), "SYSTEM: You are a helpful assistant.")
        chats.insert(j * 997 % (len(chats) + 1), f"ASSISTANT: {tx.text(80)} <|endoftext|>\n\n\n")
    _copy_json(pa.table({"system": systems, "chat": chats}), path, array=True)
    return len(chats)


def write_opencodeinstruct(path: Path, n: int, bad: int, seed: int) -> int:
    tx = Texts(seed)
    m = n + bad
    inputs = tx.many(m, 450)
    for j in _bad_idx(m, bad):
        inputs[j] = "   "  # empty prompt
    t = pa.table(
        {
            "id": [tx.hexid(32) for _ in range(m)],
            "input": inputs,
            "output": tx.many(m, 1500),
            "domain": ["generic"] * m,
            "generation_algorithm": ["self-instruct"] * m,
            "llm_judgement": ['{"requirement_conformance": {"score": 5}, "logical_correctness": {"score": 5}}'] * m,
            "unit_tests": [json.dumps([f"assert f({k}) == {k}" for k in range(3)])] * m,
            "tests_execution_status": ['["pass", "pass", "pass"]'] * m,
            "average_test_score": ["1"] * m,
        }
    )
    pq.write_table(t, path)
    return m


def write_magicoder(path: Path, n: int, bad: int, seed: int) -> int:
    tx = Texts(seed)
    m = n + bad
    problems = tx.many(m, 900)
    for j in _bad_idx(m, bad):
        problems[j] = ""
    t = pa.table(
        {
            "lang": [tx.r.choice(("python", "java", "cpp", "rust", "typescript", "shell")) for _ in range(m)],
            "raw_index": pa.array(tx.rng.integers(0, 90_000, m), pa.int64()),
            "index": pa.array(np.arange(m), pa.int64()),
            "seed": tx.many(m, 500),
            "openai_fingerprint": ["fp_44709d6fcb"] * m,
            "problem": problems,
            "solution": tx.many(m, 1100),
        }
    )
    _copy_json(t, path, array=False)
    return m


def write_mixture_of_thoughts(path: Path, n: int, bad: int, seed: int) -> int:
    tx = Texts(seed)
    msgs = []
    for _ in range(n):
        think = tx.text(tx.lengths(1, 3000)[0])
        msgs.append(
            [
                {"content": tx.text(tx.lengths(1, 700)[0]), "role": "user"},
                {"content": f"<think>\n{think}\n</think>\n\n{tx.text(tx.lengths(1, 800)[0])}", "role": "assistant"},
            ]
        )
    for j in range(bad):
        msgs.insert((j * 211) % (len(msgs) + 1), [])  # empty conversation
    t = pa.table(
        {
            "messages": pa.array(msgs, _msgs_type("content", "role")),
            "num_tokens": pa.array(tx.rng.integers(1000, 16000, len(msgs)), pa.int64()),
            "source": ["open-r1/codeforces-cots"] * len(msgs),
        }
    )
    pq.write_table(t, path)
    return len(msgs)


SKY_T1_SYSTEM = (
    "Your role as an assistant involves thoroughly exploring questions through a systematic long "
    "thinking process before providing the final precise and accurate solutions. " * 6
).strip()


def write_openthoughts(path: Path, n: int, bad: int, seed: int) -> int:
    tx = Texts(seed)
    conv = []
    for _ in range(n):
        a = (
            f"<|begin_of_thought|>\n\n{tx.text(tx.lengths(1, 3000)[0])}\n\n<|end_of_thought|>\n\n"
            f"<|begin_of_solution|>\n\n{tx.text(tx.lengths(1, 800)[0])}\n\n<|end_of_solution|>"
        )
        conv.append([{"from": "user", "value": tx.text(tx.lengths(1, 650)[0])}, {"from": "assistant", "value": a}])
    for j in range(bad):
        conv.insert((j * 157) % (len(conv) + 1), [{"from": "assistant", "value": tx.text(50)}])
    t = pa.table({"system": [SKY_T1_SYSTEM] * len(conv), "conversations": pa.array(conv, _msgs_type("from", "value"))})
    pq.write_table(t, path)
    return len(conv)


def write_ultrachat(path: Path, n: int, bad: int, seed: int) -> int:
    tx = Texts(seed)
    prompts, ids, msgs = [], [], []
    bad_rows = _bad_idx(n + bad, bad)
    for i in range(n + bad):
        first = tx.text(tx.lengths(1, 250)[0])
        m = []
        if i in bad_rows:  # assistant-first conversation: rejected by normalize
            m = [{"content": tx.text(200), "role": "assistant"}, {"content": first, "role": "user"}]
        else:
            for k in range(tx.r.randint(1, 4)):
                m.append({"content": first if k == 0 else tx.text(tx.lengths(1, 250)[0]), "role": "user"})
                m.append({"content": tx.text(tx.lengths(1, 1100)[0]), "role": "assistant"})
        prompts.append(first)
        ids.append(tx.hexid(64))
        msgs.append(m)
    t = pa.table({"prompt": prompts, "prompt_id": ids, "messages": pa.array(msgs, _msgs_type("content", "role"))})
    pq.write_table(t, path)
    return t.num_rows


def write_sharegpt(path: Path, n: int, bad: int, seed: int) -> int:
    tx = Texts(seed)
    alnum = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    ids, conv = [], []
    for i in range(n):
        c = []
        for _ in range(tx.r.choice((1, 1, 2, 2, 3, 4, 5))):
            c.append({"from": "human", "value": tx.text(tx.lengths(1, 300)[0])})
            c.append({"from": "gpt", "value": tx.text(tx.lengths(1, 900)[0])})
        ids.append("".join(tx.r.choices(alnum, k=7)) + f"_{tx.r.randint(0, 12)}")
        conv.append(c)
    for j in range(bad):
        k = (j * 331) % (len(conv) + 1)
        ids.insert(k, f"empty{j}_0")
        conv.insert(k, [])
    t = pa.table({"id": ids, "conversations": pa.array(conv, _msgs_type("from", "value"))})
    _copy_json(t, path, array=True)
    return len(conv)


SWE_SYSTEM = (
    "SETTING: You are an autonomous programmer, and you're working directly in the command line with a "
    "special interface. The special interface consists of a file editor that shows you 100 lines of a "
    "file at a time. COMMANDS: open <path> [<line_number>], goto <line_number>, scroll_down, scroll_up, "
    "create <filename>, search_dir <search_term> [<dir>], search_file <search_term> [<file>], "
    "find_file <file_name> [<dir>], edit <start_line>:<end_line> <replacement_text> end_of_edit, "
    "submit. "
) * 4


def write_nebius_swe_agent(path: Path, n: int, bad: int, seed: int) -> int:
    tx = Texts(seed)
    rows = {
        k: []
        for k in ("instance_id", "model_name", "target", "trajectory", "exit_status", "generated_patch", "eval_logs")
    }
    bad_rows = _bad_idx(n + bad, bad)
    for i in range(n + bad):
        traj = [
            {
                "cutoff_date": "01.01.2023",
                "mask": False,
                "role": "system",
                "system_prompt": SWE_SYSTEM,
                "text": SWE_SYSTEM,
            },
            {
                "cutoff_date": "01.01.2023",
                "mask": False,
                "role": "user",
                "system_prompt": "",
                "text": "We're currently solving the following issue within our repository. ISSUE:\n"
                + tx.text(tx.lengths(1, 1500)[0]),
            },
        ]
        if i in bad_rows:  # unknown role: rejected by normalize
            traj = traj[:1] + [{"cutoff_date": "", "mask": False, "role": "narrator", "system_prompt": "", "text": "?"}]
        else:
            for k in range(tx.r.randint(2, 8)):
                if k:
                    traj.append(
                        {
                            "cutoff_date": "01.01.2023",
                            "mask": False,
                            "role": "user",
                            "system_prompt": "",
                            "text": tx.text(tx.lengths(1, 500, 1.0)[0]),
                        }
                    )
                traj.append(
                    {
                        "cutoff_date": "01.01.2023",
                        "mask": True,
                        "role": "ai",
                        "system_prompt": "",
                        "text": f'DISCUSSION\n{tx.text(tx.lengths(1, 300)[0])}\n```\nsearch_dir "x"\n```',
                    }
                )
        rows["instance_id"].append(
            f"{tx.r.choice(('django', 'astropy', 'sympy', 'pylint-dev'))}__repo-{tx.r.randint(1000, 29999)}"
        )
        rows["model_name"].append(tx.r.choice(("swe-agent-llama-8b", "swe-agent-llama-70b", "swe-agent-llama-405b")))
        rows["target"].append(tx.r.random() < 0.4)
        rows["trajectory"].append(traj)
        rows["exit_status"].append("submitted")
        rows["generated_patch"].append("diff --git a/x.py b/x.py\n" + tx.text(300))
        rows["eval_logs"].append(tx.text(200))
    st = pa.struct(
        [
            ("cutoff_date", pa.string()),
            ("mask", pa.bool_()),
            ("role", pa.string()),
            ("system_prompt", pa.string()),
            ("text", pa.string()),
        ]
    )
    t = pa.table(
        {
            **{k: v for k, v in rows.items() if k != "trajectory"},
            "trajectory": pa.array(rows["trajectory"], pa.list_(st)),
        }
    )
    pq.write_table(t, path)
    return t.num_rows


# ---------------------------------------------------------------------------------------------------------------
# A-type: pre-tokenized JSONL in the tiny target's vocabulary (rendered like its chat template)


def write_pretokenized(
    path: Path, n: int, mean_tokens: float, seed: int, special_ids: dict[str, int], sigma: float = 0.5
) -> tuple[int, int]:
    """``n`` rows ``{sample_id, input_ids, loss_mask}`` averaging ``mean_tokens``; returns (rows, tokens).

    Each row is ``<|im_system|>system<|im_middle|>{sys}<|im_end|><|im_user|>user<|im_middle|>{prompt}<|im_end|>
    <|im_assistant|>assistant<|im_middle|>{completion}<|im_end|>`` with the loss mask on completion + end-of-turn;
    texts are ASCII bytes (byte id = byte value in the tiny tokenizer)."""
    rng = np.random.default_rng(seed)
    s = special_ids
    head_sys = [s["<|im_system|>"], *b"system", s["<|im_middle|>"]]
    head_user = [s["<|im_end|>"], s["<|im_user|>"], *b"user", s["<|im_middle|>"]]
    head_asst = [s["<|im_end|>"], s["<|im_assistant|>"], *b"assistant", s["<|im_middle|>"]]
    mu = np.log(mean_tokens) - sigma * sigma / 2
    total = np.clip(np.rint(rng.lognormal(mu, sigma, n)), 200, 400_000).astype(np.int64)
    fixed = len(head_sys) + len(head_user) + len(head_asst) + 1 + 60
    body = np.maximum(total - fixed, 20)
    prompt_len = np.maximum((body * rng.uniform(0.3, 0.7, n)).astype(np.int64), 10)
    comp_len = np.maximum(body - prompt_len, 10)
    lens = fixed + prompt_len + comp_len
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(lens, out=offsets[1:])
    ids = np.empty(offsets[-1], np.int32)
    mask = np.zeros(offsets[-1], np.int8)

    def chunk(k: int) -> np.ndarray:
        o = int(rng.integers(0, len(CB) - 1))
        if o + k <= len(CB):
            out = CB[o : o + k].astype(np.int32)
        else:
            out = np.take(CB, (o + np.arange(k)) % len(CB)).astype(np.int32)
        if k:
            if out[0] == 32 or out[0] == 10:
                out[0] = ord("A")
            if out[-1] == 32 or out[-1] == 10:
                out[-1] = ord(".")
        return out

    for i in range(n):
        parts = [
            np.array(head_sys, np.int32),
            chunk(60),
            np.array(head_user, np.int32),
            chunk(int(prompt_len[i])),
            np.array(head_asst, np.int32),
            chunk(int(comp_len[i])),
            np.array([s["<|im_end|>"]], np.int32),
        ]
        seq = np.concatenate(parts)
        a, b = offsets[i], offsets[i + 1]
        ids[a:b] = seq
        mask[b - int(comp_len[i]) - 1 : b] = 1
    off32 = pa.array(offsets, pa.int64())
    t = pa.table(
        {
            "sample_id": [f"{path.stem}-{i:06d}" for i in range(n)],
            "input_ids": pa.LargeListArray.from_arrays(off32, pa.array(ids)),
            "loss_mask": pa.LargeListArray.from_arrays(off32, pa.array(mask)),
        }
    )
    _copy_json(t, path, array=False)
    return n, int(offsets[-1])
