"""Paid replies found by what was asked: a rename, a reshard or a second dataset holding the same prompt reuses them.

The journal is keyed per request slot (:func:`.prompts.request_key`: dataset, sample id, turn, target, prompt, tools,
sampling), which a rename of the dataset changes. Before a job sends anything, each request its own dataset's journal
does not answer is looked up in every dataset's journal under ``journal_dir`` by what was asked: the same prompt
messages and tools (their JSON text, as journaled), to the same target, with the same sampling. A journaled record
matches when its messages and tools texts equal the request's and its own ``request_key`` is what
:func:`.prompts.request_key` gives for its dataset, sample id and turn with this job's target and sampling (so
journals written before this lookup existed are found too, and a reply asked of another target or with other
sampling never is). A match is copied into this shard's journal under this request's key, ``cost_usd`` 0 (it was
paid for once, by the record named in ``reused_from``), and answers the request like any journaled reply.

The lookup reads a small index beside each journal file, ``<shard>.jsonl.prompts``: one line per record, the
BLAKE2b digest of its messages and tools texts and the record's byte offset, under a header naming how many bytes
of the journal file it covers. Journal files are append-only, so the index only ever reads the part written since;
an index that covers more than its file holds (the file was replaced) is rebuilt. A job whose requests are all
journaled reads no index.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from pathlib import Path

from .journal import record_problem
from .prompts import request_key

logger = logging.getLogger("eagle3_data.generate")

INDEX_SUFFIX = ".prompts"
_HEADER = "eagle3-prompt-index 1"


def prompt_digest(messages: str | None, tools: str | None) -> str:
    """The 16-hex-digit BLAKE2b digest of a request's messages and tools JSON texts (as journaled)."""
    h = hashlib.blake2b(digest_size=8)
    h.update((messages or "").encode("utf-8", "surrogatepass"))
    h.update(b"\0")
    h.update((tools or "").encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def _read_index(index: Path, size: int) -> tuple[list[tuple[str, int]], int]:
    """The entries of ``index`` and the bytes of the journal file they cover (0 and none when the index is missing,
    unreadable or covers more than the file's ``size``)."""
    try:
        lines = index.read_text(encoding="ascii").splitlines()
    except (OSError, UnicodeDecodeError):
        return [], 0
    head = lines[0].rsplit(" ", 1) if lines else []
    if len(head) != 2 or head[0] != _HEADER or not head[1].isdigit() or int(head[1]) > size:
        return [], 0
    entries = []
    for line in lines[1:]:
        digest, _, offset = line.partition(" ")
        if len(digest) != 16 or not offset.isdigit():
            return [], 0
        entries.append((digest, int(offset)))
    return entries, int(head[1])


def file_index(path: Path) -> list[tuple[str, int]]:
    """``(prompt digest, byte offset)`` of every complete record of the journal file ``path``, in file order: read
    from its index, the part of the file written since indexed and the index rewritten (atomically; an index that
    can't be written is only a cost: the next job reads the file again)."""
    try:
        size = path.stat().st_size
    except OSError:
        return []
    index = path.with_name(path.name + INDEX_SUFFIX)
    entries, covered = _read_index(index, size)
    if covered == size:
        return entries
    offset = covered
    with open(path, "rb") as fh:
        fh.seek(covered)
        for raw in fh:
            if not raw.endswith(b"\n"):  # a line still being written: indexed by a later job
                break
            start, offset = offset, offset + len(raw)
            try:
                rec = json.loads(raw)
            except ValueError:
                continue
            if isinstance(rec, dict) and isinstance(rec.get("messages"), str):
                tools = rec.get("tools")
                entries.append((prompt_digest(rec["messages"], tools if isinstance(tools, str) else None), start))
    if offset > covered:
        tmp = index.with_name(f".{index.name}.{os.getpid()}.tmp")
        with contextlib.suppress(OSError):
            tmp.write_text(
                f"{_HEADER} {offset}\n" + "".join(f"{d} {o}\n" for d, o in entries),
                encoding="ascii",
            )
            os.replace(tmp, index)
        with contextlib.suppress(OSError):
            tmp.unlink()
    return entries


def _record_at(path: Path, offset: int) -> dict | None:
    """The journal record whose line starts at ``offset`` of ``path`` (None: not a complete, valid record)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            raw = fh.readline()
        rec = json.loads(raw)
    except (OSError, ValueError):
        return None
    if not isinstance(rec, dict) or not isinstance(rec.get("request_key"), str) or record_problem(rec):
        return None
    return rec


def asked_the_same(rec: dict, messages: str, tools: str | None, target_name: str, sampling: dict) -> bool:
    """True if the journaled ``rec`` answered the prompt ``messages``/``tools`` (JSON texts) asked of
    ``target_name`` with ``sampling``: equal texts, and ``rec``'s own key is its slot's key under that target and
    sampling (:func:`.prompts.request_key`)."""
    if rec.get("messages") != messages or (rec.get("tools") or None) != (tools or None):
        return False
    if not isinstance(rec.get("dataset"), str) or not isinstance(rec.get("sample_id"), str):
        return False
    if type(rec.get("turn")) is not int:
        return False
    try:
        prompt = json.loads(messages)
        tools_value = json.loads(tools) if tools else None
    except ValueError:
        return False
    key = request_key(rec["dataset"], rec["sample_id"], rec["turn"], target_name, prompt, tools_value, sampling)
    return key == rec["request_key"]


class AskedIndex:
    """Every journal file under ``journal_dir`` (``<dataset>/*.jsonl``), looked up by prompt digest."""

    def __init__(self, journal_dir: str | os.PathLike):
        self.journal_dir = Path(journal_dir)
        self._files: list[tuple[Path, list[tuple[str, int]]]] | None = None

    def _load(self) -> list[tuple[Path, list[tuple[str, int]]]]:
        if self._files is None:
            root = self.journal_dir
            paths = sorted(root.glob("*/*.jsonl")) if root.is_dir() else []
            self._files = [(p, file_index(p)) for p in paths]
        return self._files

    def candidates(self, digests: set[str]) -> dict[str, list[tuple[Path, int]]]:
        """``digest -> [(journal file, offset)]`` of the records whose prompt digest is in ``digests``."""
        found: dict[str, list[tuple[Path, int]]] = {}
        if not digests:
            return found
        for path, entries in self._load():
            for digest, offset in entries:
                if digest in digests:
                    found.setdefault(digest, []).append((path, offset))
        return found

    def find(self, wanted: list[dict], target_name: str, sampling: dict) -> dict[str, dict]:
        """For each wanted request (``{"key", "messages", "tools"}``, JSON texts), the first journaled record that
        asked the same (:func:`asked_the_same`): ``key -> record``."""
        by_digest: dict[str, list[dict]] = {}
        for w in wanted:
            by_digest.setdefault(prompt_digest(w["messages"], w["tools"]), []).append(w)
        found: dict[str, dict] = {}
        for digest, places in self.candidates(set(by_digest)).items():
            for path, offset in places:
                left = [w for w in by_digest[digest] if w["key"] not in found]
                if not left:
                    break
                rec = _record_at(path, offset)
                if rec is None:
                    continue
                for w in left:
                    if asked_the_same(rec, w["messages"], w["tools"], target_name, sampling):
                        found[w["key"]] = rec
        return found


def reused_record(rec: dict, sample_id: str, dataset: str, turn: int, key: str) -> dict:
    """The copy of the journaled ``rec`` that answers request ``key`` (``sample_id``'s ``turn`` in ``dataset``):
    its reply fields, this slot's identity, ``cost_usd`` 0 when it had a cost, ``attempts`` 0 and ``reused_from``
    ``"<dataset>/<sample_id>/<turn>"`` of the record that was paid for."""
    return {
        **rec,
        "sample_id": sample_id,
        "dataset": dataset,
        "turn": int(turn),
        "request_key": key,
        "cost_usd": None if rec.get("cost_usd") is None else 0.0,
        "attempts": 0,
        "reused_from": rec.get("reused_from") or f"{rec['dataset']}/{rec['sample_id']}/{rec['turn']}",
    }


def reuse_replies(runner, samples: list, records: dict, key_files: dict, writer, keep: tuple) -> dict[str, int]:
    """Answer from other journal records what ``records`` (this dataset's resume index) does not: walk each
    sample's turns (``runner.steps``; mode ``all`` walks on through the regenerated history, so a later turn is
    looked up once the turns before it are found), find the unanswered requests in every dataset's journal
    (:class:`AskedIndex`) and append their copies (:func:`reused_record`) to ``writer`` (this shard's
    :class:`.journal.JournalWriter`), adding them to ``records`` (``keep`` fields) and ``key_files``.

    Returns ``{source dataset: replies reused}``. Raises :class:`.journal.JournalWriteError` when the journal can't
    take a copy (nothing is paid for: the rerun finds them again)."""
    index = AskedIndex(writer.path.parent.parent)
    reused: dict[str, int] = {}
    todo = list(samples)
    while todo:
        wanted, owner = [], {}
        for s in todo:
            gen = runner.steps(s)
            item = next(gen)
            while True:
                turn, prompt, tools, key, rec = item
                if rec is None:
                    text = json.dumps(prompt, ensure_ascii=False)
                    tools_text = json.dumps(tools, ensure_ascii=False) if tools else None
                    wanted.append({"key": key, "messages": text, "tools": tools_text})
                    owner[key] = (s, turn)
                    break
                if rec.get("status") == "failed":
                    break
                try:
                    item = gen.send(rec)
                except StopIteration:
                    break
        found = index.find(wanted, runner.target_name, runner.sampling) if wanted else {}
        if not found:
            break
        todo = []
        for key, rec in found.items():
            s, turn = owner[key]
            copy = reused_record(rec, s.sample_id, runner.dataset, turn, key)
            writer.append(copy)
            records[key] = copy if keep is None else {k: copy.get(k) for k in keep}
            key_files[key] = writer.path
            src = copy["reused_from"].split("/", 1)[0]
            reused[src] = reused.get(src, 0) + 1
            todo.append(s)
    return reused
