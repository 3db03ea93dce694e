"""Loss-mask view: one sample's tokens with the supervised ones (loss mask 1) marked, in the terminal or as HTML.

    python -m eagle3_data.view results/sharegpt_demo/validated/000.parquet --index 0
    python -m eagle3_data.view results/merged/000.parquet --sample <sample_id> --html sample.html

Works on every file that holds ``input_ids`` and ``loss_mask``: TOKENS, VALIDATED and MERGED (``schemas.py``).
Each token is shown as the text the target tokenizer decodes it to, so token boundaries, special tokens (the
tokenizer's added tokens: ``<|im_end|>``, ``<think>``, tool-call markers) and the turns the chat template wrote
are visible as the draft model is trained on them. Supervised tokens (the regenerated completion, end-of-turn
included) are green, the rest (system, user, tool and earlier turns: context only) grey; alternating shades mark
the token boundaries; ``▶ completion`` / ``◀ end of completion`` mark every switch of the loss mask (the
prompt/completion split; several in ``generation.mode: all``). Without colour (not a terminal, ``NO_COLOR``
set, ``--color never``) the same is written in text: supervised runs inside ``⟦ ⟧``, a ``│`` between tokens.
``--table`` lists one token per line (index, id, mask, special, text).

The tokenizer is the target's (``--tokenizer DIR``; by default ``target.path`` and ``target.trust_remote_code``
of ``--config FILE``, or of ``config.yaml`` in the working directory, as ``snakemake`` reads it).

A token that ends inside a multi-byte UTF-8 character decodes to nothing on its own: it is shown as ``·`` and
the character appears on the token that completes it (the same rule as incremental detokenizers in serving
engines: text is emitted once its bytes are complete).
"""

from __future__ import annotations

import argparse
import html
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.parquet as pq

#: tokens of context decoded before each token to find its own text (>= 4: the longest UTF-8 character)
DECODE_WINDOW = 8
#: visible stand-ins for characters that would be invisible or move the layout
_SHOWN = {"\n": "↵\n", "\t": "⇥   ", "\r": "␍", "\x7f": "␡"}  # a tab: its sign and 3 spaces
_SHOWN.update({chr(c): chr(0x2400 + c) for c in range(32) if chr(c) not in _SHOWN})
PENDING = "·"  # a token whose bytes end inside a character (its text is on the next token)


@dataclass
class SampleView:
    """One sample ready to render: ``ids``/``mask`` as stored, ``texts[i]`` the decoded text of token ``i``
    ("" when it ends inside a multi-byte character), ``special[i]`` whether it is an added (special) token."""

    sample_id: str
    dataset: str
    ids: list[int]
    mask: list[int]
    texts: list[str]
    special: list[bool]
    where: str = ""  # "<file> row <n> (<kind>)"
    meta: dict = field(default_factory=dict)  # ids_source, finish_reason, truncated, reject_reason, ...

    @property
    def supervised(self) -> int:
        return sum(1 for m in self.mask if m)

    def spans(self) -> list[tuple[int, int, int]]:
        """Runs of equal loss mask: ``(start, end, mask)`` with ``end`` exclusive."""
        out: list[tuple[int, int, int]] = []
        for i, m in enumerate(self.mask):
            if out and out[-1][2] == m:
                out[-1] = (out[-1][0], i + 1, m)
            else:
                out.append((i, i + 1, int(m)))
        return out


# ------------------------------------------------------------------------------------------ data


def file_kind(names: list[str]) -> str:
    """``tokens`` | ``validated`` | ``merged`` from a parquet file's column names (ValueError if it has no
    ``input_ids``/``loss_mask``)."""
    if "input_ids" not in names or "loss_mask" not in names:
        raise ValueError(
            "no input_ids/loss_mask columns: expected a tokens, validated or merged parquet file "
            f"(schemas.py); columns are {names}"
        )
    if "num_supervised" in names:
        return "merged"
    return "tokens" if "reject_reason" in names else "validated"


def load_row(path, *, sample_id: str | None = None, index: int | None = None) -> tuple[dict, int, str]:
    """The row of ``path`` with ``sample_id`` or at 0-based ``index`` (negative counts from the end; default 0);
    returns ``(row as dict, its index, file kind)``.

    Raises FileNotFoundError, or ValueError naming the file: not a tokens/validated/merged file, no such
    sample, an index out of range, a sample id in several rows (the stage files keep ids unique).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    try:
        pf = pq.ParquetFile(path)
    except Exception as exc:
        raise ValueError(f"{path}: not a parquet file ({exc})") from None
    try:
        kind = file_kind(pf.schema_arrow.names)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    n = pf.metadata.num_rows
    if sample_id is not None:
        sids = pf.read(columns=["sample_id"]).column("sample_id").to_pylist()
        hits = [i for i, s in enumerate(sids) if s == sample_id]
        if not hits:
            raise ValueError(f"{path}: no sample {sample_id!r} among its {n:,} rows (e.g. {sids[:3]})")
        if len(hits) > 1:
            raise ValueError(
                f"{path}: sample {sample_id!r} is in {len(hits)} rows ({hits[:5]}); choose one with --index"
            )
        index = hits[0]
    index = 0 if index is None else int(index)
    if not -n <= index < n:
        raise ValueError(f"{path}: row index {index} out of range (the file has {n:,} rows)")
    index %= n
    start = 0
    for g in range(pf.num_row_groups):
        rows = pf.metadata.row_group(g).num_rows
        if index < start + rows:
            return pf.read_row_group(g).slice(index - start, 1).to_pylist()[0], index, kind
        start += rows
    raise AssertionError("unreachable: index checked against the row count")


def resolve_tokenizer(tokenizer: str | None = None, config: str | None = None) -> tuple[str, bool]:
    """``(tokenizer directory, trust_remote_code)``: ``tokenizer`` when given (remote code trusted only if the
    config says so), else ``target.path`` of ``config`` (default: ``config.yaml`` in the working directory).

    A relative ``target.path`` is taken from the working directory (as ``snakemake`` does), else from the
    config file's directory. Raises FileNotFoundError / ValueError saying what to pass.
    """
    import yaml

    cfg_path = Path(config) if config else Path("config.yaml")
    target: dict = {}
    if cfg_path.is_file():
        target = (yaml.safe_load(cfg_path.read_text()) or {}).get("target") or {}
    elif config:
        raise FileNotFoundError(f"--config {config}: no such file")
    trust = bool(target.get("trust_remote_code", False))
    if tokenizer:
        return str(tokenizer), trust
    if not target.get("path"):
        raise ValueError(
            "no target tokenizer: pass --tokenizer DIR (the target model's tokenizer directory) or "
            "--config FILE (a workflow config whose target.path names it)"
        )
    p = Path(target["path"])
    if not p.is_absolute() and not p.exists() and (cfg_path.parent / p).exists():
        p = cfg_path.parent / p
    if not p.exists():
        raise FileNotFoundError(
            f"target.path {target['path']} of {cfg_path} does not exist (the demo's tiny target "
            "is built by `snakemake tiny_target`); or pass --tokenizer DIR"
        )
    return str(p), trust


def load_tokenizer(path: str, trust_remote_code: bool = False):
    """The target tokenizer of a local directory: its ``tokenizer.json`` loaded by ``tokenizers`` when there is
    one (decoding is the same as the transformers fast tokenizer's, whose backend it is, and a view starts in
    0.2 s instead of the ~8 s CPU of importing transformers), else ``AutoTokenizer`` (e.g. Kimi's tiktoken
    tokenizer, ``trust_remote_code``). Raises ValueError naming the directory."""
    p = Path(path)
    try:
        if (p / "tokenizer.json").is_file():
            from tokenizers import Tokenizer

            return Tokenizer.from_file(str(p / "tokenizer.json"))
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(p), trust_remote_code=trust_remote_code)
    except Exception as exc:
        hint = (
            ""
            if trust_remote_code
            else " (a tokenizer with its own code, e.g. Kimi's: set "
            "target.trust_remote_code: true in the config or pass --trust-remote-code)"
        )
        raise ValueError(f"{path}: cannot load the target tokenizer: {exc}{hint}") from exc


def _decode_batch(tok, seqs: list[list[int]]) -> list[str]:
    """Decode id sequences keeping special tokens and spacing as they are (one batched call); ``tok`` is a
    ``tokenizers.Tokenizer`` or a transformers tokenizer."""
    if hasattr(tok, "decode_batch"):  # tokenizers.Tokenizer
        return tok.decode_batch(seqs, skip_special_tokens=False)
    backend = getattr(tok, "backend_tokenizer", None) if getattr(tok, "is_fast", False) else None
    if backend is not None:
        return backend.decode_batch(seqs, skip_special_tokens=False)
    return tok.batch_decode(seqs, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def token_texts(tok, ids: list[int], window: int = DECODE_WINDOW) -> list[str]:
    """The text of each token in context: ``texts[i]`` = what decoding ``ids[:i+1]`` adds to ``ids[:i]``
    (computed on the last ``window`` tokens, in one batched decode). A token that ends inside a multi-byte
    character gets only its complete characters (often ""); the token completing the character carries it.
    ``"".join(texts)`` equals the decode of ``ids`` for byte-level BPE tokenizers.
    """
    n = len(ids)
    if not n:
        return []
    starts = [max(0, i - window) for i in range(n)]
    dec = _decode_batch(
        tok, [list(ids[s:i]) for i, s in enumerate(starts)] + [list(ids[s : i + 1]) for i, s in enumerate(starts)]
    )
    out = []
    for i in range(n):
        prev, full = dec[i].rstrip("\ufffd"), dec[n + i]  # prev's incomplete trailing bytes are completed here
        if full.startswith(prev):
            out.append(full[len(prev) :].rstrip("\ufffd"))
        else:  # a decoder that rewrites its context (rare): the token alone
            out.append(_decode_batch(tok, [[ids[i]]])[0])
    return out


def special_ids(tok) -> set[int]:
    """Ids of the tokenizer's special and other added tokens (role markers, end of turn, think and tool-call
    markers): the tokens a chat template writes, not text."""
    if hasattr(tok, "get_added_tokens_decoder"):  # tokenizers.Tokenizer
        return {int(i) for i in tok.get_added_tokens_decoder()}
    out = {int(i) for i in (getattr(tok, "all_special_ids", None) or [])}
    out.update(int(i) for i in (getattr(tok, "added_tokens_decoder", None) or {}))
    return out


def sample_view(row: dict, tok, *, where: str = "") -> SampleView:
    """A :class:`SampleView` of a TOKENS/VALIDATED/MERGED row dict (``input_ids``, ``loss_mask``, ...)."""
    ids = [int(i) for i in row["input_ids"] or []]
    mask = [int(m) for m in row["loss_mask"] or []]
    if len(mask) != len(ids):
        raise ValueError(
            f"{where or 'row'}: sample {row.get('sample_id')!r} has {len(ids)} input_ids but "
            f"{len(mask)} loss_mask values"
        )
    sp = special_ids(tok)
    meta = {
        k: row[k]
        for k in (
            "ids_source",
            "finish_reason",
            "backend",
            "truncated",
            "reject_stage",
            "reject_reason",
            "reject_detail",
        )
        if row.get(k) is not None
    }
    return SampleView(
        str(row.get("sample_id")),
        str(row.get("dataset") or ""),
        ids,
        mask,
        token_texts(tok, ids),
        [i in sp for i in ids],
        where,
        meta,
    )


# ------------------------------------------------------------------------------------------ rendering


def shown(text: str) -> str:
    """``text`` with newlines, tabs and other control characters made visible (``↵``, ``⇥``, ``␍``, ...);
    a token with no text of its own (inside a multi-byte character) as ``·``."""
    if not text:
        return PENDING
    return "".join(_SHOWN.get(c, c) for c in text)


def _elided(view: SampleView, context: int | None) -> list[tuple[str, int, int]]:
    """What to draw: ``("tokens", start, end)`` pieces and ``("gap", start, end)`` for masked runs longer than
    ``2 * context`` tokens, of which only the first and last ``context`` are drawn (``None``: everything)."""
    out: list[tuple[str, int, int]] = []
    for s, e, m in view.spans():
        if m or context is None or e - s <= 2 * context:
            out.append(("tokens", s, e))
        else:
            out += [("tokens", s, s + context), ("gap", s + context, e - context), ("tokens", e - context, e)]
    return out


def summary(view: SampleView) -> list[str]:
    """Header lines: which sample, where from, counts."""
    runs = sum(1 for *_, m in view.spans() if m)
    n, sup = len(view.ids), view.supervised
    meta = ", ".join(f"{k} {v}" for k, v in view.meta.items())
    return [
        f"sample {view.sample_id} · dataset {view.dataset}" + (f" · {view.where}" if view.where else ""),
        f"{n:,} tokens: {n - sup:,} context (loss mask 0), {sup:,} supervised (loss mask 1) in {runs} span(s)"
        + (f" · {meta}" if meta else ""),
    ]


# colour mode: two shades per kind so neighbouring tokens are told apart
_STYLE_SUP = ("black on #b7e4c7", "black on #8fd3a8")
_STYLE_CTX = ("grey70 on grey15", "grey70 on grey23")
_STYLE_MARK = {1: ("bold white on dark_green", " ▶ completion "), 0: ("bold white on grey37", " ◀ end of completion ")}


def render_rich(view: SampleView, *, context: int | None = None):
    """The sample as a ``rich.text.Text`` (colour: supervised green, context grey, special tokens bold magenta,
    alternating shades at token boundaries, a marker at every loss-mask switch)."""
    from rich.text import Text

    out = Text()
    prev_mask = None
    for what, s, e in _elided(view, context):
        if what == "gap":
            out.append(f" … {e - s:,} context tokens not shown … ", style="italic grey70 on grey30")
            continue
        for i in range(s, e):
            m = view.mask[i]
            if prev_mask is not None and m != prev_mask:
                style, label = _STYLE_MARK[m]
                out.append(label, style=style)
            prev_mask = m
            style = (_STYLE_SUP if m else _STYLE_CTX)[i % 2]
            if view.special[i]:
                style += " bold #e040fb" if not m else " bold #7b1fa2"
            out.append(shown(view.texts[i]), style=style)
    return out


def legend_rich():
    from rich.text import Text

    t = Text("legend: ")
    t.append("supervised (loss mask 1)", style=_STYLE_SUP[0])
    t.append(" ")
    t.append("context (loss mask 0)", style=_STYLE_CTX[0])
    t.append(" ")
    t.append("<special>", style=_STYLE_CTX[1] + " bold #e040fb")
    t.append("  shades alternate at token boundaries; ↵ newline, ⇥ tab, · part of a multi-byte character")
    return t


def render_plain(view: SampleView, *, context: int | None = None) -> str:
    """The sample as plain text: ``│`` between tokens, supervised runs inside ``⟦ ⟧``, elided context as
    ``[… N context tokens not shown …]``."""
    parts = []
    for what, s, e in _elided(view, context):
        if what == "gap":
            parts.append(f"[… {e - s:,} context tokens not shown …]")
            continue
        for i in range(s, e):
            open_ = view.mask[i] and (i == 0 or not view.mask[i - 1])
            close = view.mask[i] and (i == len(view.mask) - 1 or not view.mask[i + 1])
            parts.append(("⟦" if open_ else "") + shown(view.texts[i]) + ("⟧" if close else ""))
    return "│".join(parts)


def legend_plain() -> str:
    return (
        "legend: ⟦…⟧ supervised (loss mask 1), outside: context (loss mask 0); │ token boundary; "
        "↵ newline, ⇥ tab, · part of a multi-byte character"
    )


def render_table(view: SampleView) -> str:
    """One line per token: index, id, loss mask, ``S`` for a special token, the token text (Python repr)."""
    lines = [f"{'index':>7} {'id':>8} mask special text"]
    lines += [
        f"{i:>7} {t:>8} {m:>4} {'S' if s else '':>7} {x!r}"
        for i, (t, m, s, x) in enumerate(zip(view.ids, view.mask, view.special, view.texts))
    ]
    return "\n".join(lines)


HTML_CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: #1f2328; margin: 1rem 1.25rem; }
h1 { font-size: 1.3rem; margin: 0 0 .5rem; } h2 { font-size: 1.05rem; margin: 1.5rem 0 .25rem; }
.meta { color: #57606a; margin: .1rem 0; }
.legend span { margin-right: .6rem; }
.tokens { font: 13px/1.7 ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; white-space: pre-wrap;
  overflow-wrap: anywhere; border: 1px solid #d0d7de; border-radius: 6px; padding: .6rem; background: #fff; }
.t { border-radius: 2px; }
.m0 { color: #57606a; background: #e6eaef; } .m0.o { background: #cdd5de; }
.m1 { color: #0f3d1f; background: #b7e4c7; } .m1.o { background: #7fcf9c; }
.sp { font-weight: 700; color: #8e24aa; outline: 1px solid #ce93d8; white-space: nowrap; }
.pend { color: #8c959f; }
.mark { font: 700 11px system-ui, sans-serif; color: #fff; padding: 0 .35rem; margin: 0 .15rem; border-radius: 3px; }
.mark.c1 { background: #1a7f37; } .mark.c0 { background: #6e7781; }
.gap { font-style: italic; color: #57606a; background: #f6f8fa; border: 1px dashed #afb8c1; padding: 0 .4rem; }
"""


def render_html_body(view: SampleView, *, context: int | None = None) -> str:
    """One sample as an HTML fragment: a heading, the summary, and every token as
    ``<span class="t m{mask}[ o][ sp]" data-i data-id data-mask title>`` (``o``: odd index, the alternating shade;
    ``sp``: special token), with ``<span class="mark c1|c0">`` at each loss-mask switch."""
    head, info = summary(view)
    parts = [
        f"<h2>{html.escape(view.sample_id)}</h2>",
        f'<p class="meta">{html.escape(head)}<br>{html.escape(info)}</p>',
        '<div class="tokens">',
    ]
    prev_mask = None
    for what, s, e in _elided(view, context):
        if what == "gap":
            parts.append(
                f'<span class="gap" data-start="{s}" data-end="{e}">… {e - s:,} context tokens not shown …</span>'
            )
            continue
        for i in range(s, e):
            m = view.mask[i]
            if prev_mask is not None and m != prev_mask:
                parts.append(f'<span class="mark c{m}" data-at="{i}">{_STYLE_MARK[m][1].strip()}</span>')
            prev_mask = m
            text = view.texts[i]
            cls = f"t m{m}" + (" o" if i % 2 else "") + (" sp" if view.special[i] else "") + ("" if text else " pend")
            title = (
                f"#{i} id {view.ids[i]} loss mask {m}"
                + (" special" if view.special[i] else "")
                + ("" if text else " (part of a multi-byte character)")
            )
            parts.append(
                f'<span class="{cls}" data-i="{i}" data-id="{view.ids[i]}" data-mask="{m}" '
                f'title="{title}">{html.escape(shown(text))}</span>'
            )
    parts.append("</div>")
    return "".join(parts)


def html_page(views: list[SampleView], *, title: str, context: int | None = None, intro: str = "") -> str:
    """A self-contained HTML page (inline CSS, no script, nothing loaded from elsewhere) of ``views``."""
    legend = (
        '<p class="legend meta"><span class="t m1">supervised (loss mask 1)</span>'
        '<span class="t m0">context (loss mask 0)</span><span class="t m0 sp">&lt;special&gt;</span>'
        '<span class="mark c1">▶ completion</span><span class="mark c0">◀ end of completion</span>'
        "shades alternate at token boundaries (hover a token for its index, id and mask); "
        "↵ newline, ⇥ tab, · part of a multi-byte character</p>"
    )
    body = "\n".join(render_html_body(v, context=context) for v in views)
    intro_html = f'<p class="meta">{html.escape(intro)}</p>' if intro else ""
    return (
        f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n<title>{html.escape(title)}</title>\n'
        f"<style>{HTML_CSS}</style>\n</head>\n<body>\n<h1>{html.escape(title)}</h1>{intro_html}{legend}\n{body}\n"
        "</body>\n</html>\n"
    )


# ------------------------------------------------------------------------------------------ report examples


def pick_examples(paths, n: int = 3) -> list[tuple[str, str]]:
    """``n`` samples spread over the length distribution of the rows in ``paths``: ``(path, sample_id)`` at
    the length quantiles ``(k + 0.5) / n`` (rows ordered by ``num_tokens`` then ``sample_id``; deterministic)."""
    rows = []
    for p in paths:
        t = pq.read_table(p, columns=["sample_id", "num_tokens"])
        rows += [
            (nt, sid, str(p)) for sid, nt in zip(t.column("sample_id").to_pylist(), t.column("num_tokens").to_pylist())
        ]
    rows.sort(key=lambda r: (r[0] or 0, r[1]))
    if not rows:
        return []
    picks = sorted({min(len(rows) - 1, int((k + 0.5) * len(rows) / n)) for k in range(n)})
    return [(rows[i][2], rows[i][1]) for i in picks]


def write_examples(paths, out_html, *, dataset: str, tokenizer, n: int = 3, context: int | None = 256) -> list[str]:
    """Write an HTML page of ``n`` samples of ``dataset`` (from its VALIDATED files ``paths``, spread over their
    lengths: :func:`pick_examples`) to ``out_html`` atomically; context runs longer than ``2 * context`` tokens
    are shortened to their first and last ``context``. ``tokenizer``: :func:`load_tokenizer`'s. Returns the
    sample ids shown."""
    from .files import write_text

    views = []
    for path, sid in pick_examples(paths, n):
        row, idx, kind = load_row(path, sample_id=sid)
        views.append(sample_view(row, tokenizer, where=f"{path} row {idx} ({kind})"))
    intro = (
        (
            f"{len(views)} validated samples of {dataset}, spread over its length distribution (shorter to "
            "longer), as the draft model is trained on them. Any sample: python -m eagle3_data.view "
            "<parquet> --sample ID [--html out.html]."
        )
        if views
        else f"{dataset} has no validated sample."
    )
    write_text(html_page(views, title=f"Loss mask: {dataset}", context=context, intro=intro), out_html)
    return [v.sample_id for v in views]


def write_report_examples(
    validated: dict[str, list], outputs: list, *, target: dict, n: int = 3, context: int | None = 256
) -> None:
    """Rule view: for each dataset of ``validated`` (name -> its VALIDATED files, in the order of ``outputs``)
    :func:`write_examples` to the matching path of ``outputs``, decoded by the tokenizer at ``target["path"]``
    (``target["trust_remote_code"]``)."""
    import logging

    if len(validated) != len(outputs):
        raise ValueError(f"view: {len(validated)} datasets but {len(outputs)} output paths")
    tok = load_tokenizer(target["path"], bool(target.get("trust_remote_code", False)))
    for (ds, paths), out in zip(validated.items(), outputs):
        shown_ids = write_examples(paths, out, dataset=ds, tokenizer=tok, n=n, context=context)
        logging.getLogger("eagle3_data.view").info(
            "%s: %d examples (%s) -> %s", ds, len(shown_ids), ", ".join(shown_ids), out
        )


# ------------------------------------------------------------------------------------------ command line


def _use_color(mode: str, stream) -> bool:
    if mode != "auto":
        return mode == "always"
    return (
        bool(getattr(stream, "isatty", lambda: False)())
        and not os.environ.get("NO_COLOR")
        and os.environ.get("TERM") != "dumb"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m eagle3_data.view",
        description="Show one sample's tokens with its loss mask (supervised tokens marked), from a tokens, "
        "validated or merged parquet file, in the terminal or as HTML.",
    )
    ap.add_argument("parquet", help="a tokens, validated or merged parquet file")
    pick = ap.add_mutually_exclusive_group()
    pick.add_argument("--sample", metavar="ID", help="the sample's sample_id")
    pick.add_argument("--index", metavar="N", type=int, help="0-based row in the file (default 0; -1: the last)")
    ap.add_argument(
        "--tokenizer", metavar="DIR", help="the target tokenizer directory (default: target.path of --config)"
    )
    ap.add_argument(
        "--config",
        metavar="FILE",
        help="workflow config naming the target (default: config.yaml in the working directory)",
    )
    ap.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="load a tokenizer that ships its own code (default: the config's target.trust_remote_code)",
    )
    ap.add_argument("--html", metavar="OUT", help="write a self-contained HTML page to OUT instead")
    ap.add_argument(
        "--color",
        choices=["auto", "always", "never"],
        default="auto",
        help="colour in the terminal (auto: when writing to a terminal and NO_COLOR is unset)",
    )
    ap.add_argument("--table", action="store_true", help="one line per token: index, id, mask, special, text")
    ap.add_argument(
        "--context",
        metavar="K",
        type=int,
        help="shorten context runs longer than 2K tokens to their first and last K tokens (default: show everything)",
    )
    args = ap.parse_args(argv)
    try:
        tok_dir, trust = resolve_tokenizer(args.tokenizer, args.config)
        row, idx, kind = load_row(args.parquet, sample_id=args.sample, index=args.index)
        tok = load_tokenizer(tok_dir, trust or args.trust_remote_code)
        view = sample_view(row, tok, where=f"{args.parquet} row {idx} ({kind})")
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.html:
        from .files import write_text

        write_text(html_page([view], title=f"Loss mask: {view.sample_id}", context=args.context), args.html)
        print(f"wrote {args.html} ({len(view.ids):,} tokens, {view.supervised:,} supervised)")
        return 0
    out = sys.stdout
    if args.table:
        print("\n".join(summary(view)), file=out)
        print(render_table(view), file=out)
    elif _use_color(args.color, out):
        from rich.console import Console

        con = Console(
            file=out,
            force_terminal=True,
            color_system="truecolor" if args.color == "always" else "auto",
            highlight=False,
            emoji=False,
            markup=False,
            no_color=False,
        )
        con.print("\n".join(summary(view)), style="bold", soft_wrap=True)
        con.print(legend_rich(), soft_wrap=True)
        con.print(render_rich(view, context=args.context), soft_wrap=True)
    else:
        print("\n".join(summary(view)), file=out)
        print(legend_plain(), file=out)
        print(render_plain(view, context=args.context), file=out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
