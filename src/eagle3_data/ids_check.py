"""Are a build's token ids the target's own? Each validated sample against its chat template's finished render.

For each validated sample of a generated dataset, the prompt messages that were sent and the reply (content,
reasoning, tool calls; ``results/<ds>/responses/``) are rendered as one finished conversation by the target's own
chat template, tokenized by it (``apply_chat_template(..., tokenize=True)``, plain transformers: none of this
package's template code). The sample's ``input_ids`` must be the start of that render, up to the end of the
reply's end-of-turn token; what the render adds after them is the *tail*: for a ChatML template (SmolLM2, Qwen)
the ``"\\n"`` it writes after ``<|im_end|>``; for a reply cut at ``max_tokens`` (kept with
``validate.keep_truncated``) the end of turn as well, ``"<|im_end|>\\n"``.

Where the reply's ids are a server's own (``ids_source: exact``, vLLM's ``return_token_ids``), the engine may have
split a piece of the reply's text into other tokens than the tokenizer would (its sampled path, not the canonical
encoding). Such a sample counts as the render when its prompt ids are the render's and its ids decode to the start
of the render's text: it is reported as *resplit*, with the same tail.

This holds for templates that render a finished assistant turn as it was generated (``generic``, ``llama3``,
Qwen3 without thinking ...), not for those that drop the final turn's reasoning from a finished conversation
(Kimi K2-Thinking / K2.5, DeepSeek-R1): there the sample's ids are right and the render differs.

Command line (after a build; exit status 1 when a sample differs)::

    python -m eagle3_data.ids_check --configfile resources/configs/real-small.yaml
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["IdsMismatch", "DatasetCheck", "finished_render_ids", "render_tail", "resplit_tail", "check_dataset", "main"]


class IdsMismatch(ValueError):
    """A sample's ids are not the start of the target's render of the finished conversation."""


def finished_render_ids(
    tok, messages: list[dict], reply: dict, tools: list[dict] | None = None, chat_template_kwargs: dict | None = None
) -> list[int]:
    """Ids of the finished conversation ``messages + [reply]`` as the tokenizer's chat template renders it
    (``add_generation_prompt=False``, ``tokenize=True``; a BatchEncoding's ``input_ids`` taken).

    ``tok``: a transformers tokenizer with a chat template; ``reply``: the assistant message (``content``, and
    ``reasoning_content`` / ``tool_calls`` when the reply has them)."""
    out = tok.apply_chat_template(
        list(messages) + [reply],
        tools=tools or None,
        add_generation_prompt=False,
        tokenize=True,
        **(chat_template_kwargs or {}),
    )
    if hasattr(out, "keys") and "input_ids" in out:
        out = out["input_ids"]
    return [int(i) for i in out]


def render_tail(input_ids: list[int], finished: list[int]) -> list[int]:
    """The ids ``finished`` has after ``input_ids`` (``input_ids`` must be a prefix of it).

    Raises :class:`IdsMismatch` naming the first position where they differ (or that ``input_ids`` is longer)."""
    n = len(input_ids)
    for i, (a, b) in enumerate(zip(input_ids, finished)):
        if a != b:
            raise IdsMismatch(f"position {i} of {n}: the sample has id {a}, the finished render {b}")
    if n > len(finished):
        raise IdsMismatch(f"the sample has {n} ids, the finished render only {len(finished)}")
    return list(finished[n:])


@dataclass
class DatasetCheck:
    """One dataset's result: ``samples`` checked, ``tails`` (finish reason, decoded tail) -> count,
    ``mismatches`` as ``(sample_id, detail)``, and ``resplit``: the exact-id samples that are the render's text
    in the engine's own tokens (counted as matching)."""

    dataset: str
    samples: int = 0
    tails: Counter = field(default_factory=Counter)
    mismatches: list = field(default_factory=list)
    resplit: int = 0

    def line(self) -> str:
        """One line: how many samples matched and the tails seen."""
        ok = self.samples - len(self.mismatches)
        tails = ", ".join(f"{tail!r} x{n} ({reason})" for (reason, tail), n in sorted(self.tails.items()))
        text = (
            f"{self.dataset}: {ok}/{self.samples} validated samples are the target's render of the finished "
            f"conversation up to the reply's end of turn; the render's tail after them: {tails or 'none'}"
        )
        if self.resplit:
            text += f"; {self.resplit} of them the same text in the engine's own tokens (exact ids)"
        if self.mismatches:
            sid, detail = self.mismatches[0]
            text += f"; {len(self.mismatches)} differ, e.g. {sid}: {detail}"
        return text


def _reply(row: dict) -> dict:
    reply = {"role": "assistant", "content": row.get("content") or ""}
    if row.get("reasoning"):
        reply["reasoning_content"] = row["reasoning"]
    if row.get("tool_calls"):
        reply["tool_calls"] = json.loads(row["tool_calls"])
    return reply


def check_dataset(config: dict, ds: str, tok, root: str | Path = ".") -> DatasetCheck:
    """Check every validated sample of generated dataset ``ds`` (its shards under ``root/results/``) against the
    finished render of ``tok``. ``config``: the workflow config (shards, chat-template variables). Raises
    FileNotFoundError naming a missing shard file."""
    import pyarrow.parquet as pq

    from .config import shard_names
    from .settings import TokenizeSettings

    ts = TokenizeSettings.from_config(config, ds)
    kwargs = {**(ts.target.chat_template_kwargs or {}), **(ts.chat_template_kwargs or {})}
    res = DatasetCheck(ds)
    for shard in shard_names(config, ds):
        paths = {k: Path(root) / f"results/{ds}/{k}/{shard}.parquet" for k in ("validated", "responses")}
        for p in paths.values():
            if not p.is_file():
                raise FileNotFoundError(f"{p} does not exist: run the build first")
        replies = {}
        for r in pq.read_table(paths["responses"]).to_pylist():
            if r["status"] == "ok" and (r["sample_id"] not in replies or r["turn"] > replies[r["sample_id"]]["turn"]):
                replies[r["sample_id"]] = r
        columns = ["sample_id", "input_ids", "finish_reason", "ids_source", "num_prompt_tokens"]
        for row in pq.read_table(paths["validated"], columns=columns).to_pylist():
            r = replies[row["sample_id"]]
            finished = finished_render_ids(
                tok, json.loads(r["messages"]), _reply(r), json.loads(r["tools"]) if r["tools"] else None, kwargs
            )
            res.samples += 1
            try:
                tail = tok.decode(render_tail(row["input_ids"], finished), skip_special_tokens=False)
            except IdsMismatch as exc:
                tail = resplit_tail(tok, row, finished)
                if tail is None:
                    res.mismatches.append((row["sample_id"], str(exc)))
                    continue
                res.resplit += 1
            res.tails[(row["finish_reason"], tail)] += 1
    return res


def resplit_tail(tok, row: dict, finished: list[int]) -> str | None:
    """For an exact-id sample whose prompt ids are the render's: the render's text after the sample's decoded text,
    when the sample's text is the start of the render's (the engine split the reply into other tokens); else None."""
    n = row["num_prompt_tokens"]
    if row["ids_source"] != "exact" or row["input_ids"][:n] != finished[:n]:
        return None
    ours = tok.decode(row["input_ids"], skip_special_tokens=False)
    render = tok.decode(finished, skip_special_tokens=False)
    return render[len(ours) :] if render.startswith(ours) else None


def main(argv: list[str] | None = None) -> int:
    """``python -m eagle3_data.ids_check --configfile FILE [FILE ...] [--dataset NAME ...]``: one line per
    generated dataset; exit status 1 when a sample differs, 2 on a missing file."""
    import yaml

    ap = argparse.ArgumentParser(prog="python -m eagle3_data.ids_check", description=__doc__.splitlines()[0])
    ap.add_argument(
        "--configfile",
        nargs="+",
        default=["config.yaml"],
        help="the build's config file(s), merged key by key as snakemake does (default: config.yaml)",
    )
    ap.add_argument("--dataset", action="append", help="only this dataset (repeatable)")
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    from .config import deep_merge, generated_datasets

    config: dict = {}
    for name in args.configfile:
        config = deep_merge(config, yaml.safe_load(Path(name).read_text()))
    target = config["target"]
    if not Path(target["path"]).is_dir():
        print(f"target.path: {target['path']} does not exist: run the build first", file=sys.stderr)
        return 2
    tok = AutoTokenizer.from_pretrained(target["path"], trust_remote_code=bool(target.get("trust_remote_code")))
    bad = 0
    for ds in args.dataset or generated_datasets(config):
        try:
            res = check_dataset(config, ds, tok)
        except FileNotFoundError as exc:
            print(f"{ds}: {exc}", file=sys.stderr)
            return 2
        print(res.line())
        bad += len(res.mismatches)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
