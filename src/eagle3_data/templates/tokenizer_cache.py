"""A local on-disk cache of loaded target tokenizers, so a shard's tokenize and validate jobs (and every other
shard's) load the target tokenizer from its directory once per machine instead of once per job.

``AutoTokenizer.from_pretrained`` of a large vocabulary (Qwen3's 151,669 tokens) costs seconds per job: transformers
rebuilds its added-token tables and probes the pipeline (``templates.as_shipped``). The cache stores the loaded
tokenizer object (pickled; a fast tokenizer's Rust half is stored as its ``tokenizer.json`` text) under a key made of
the SHA-256 of every tokenizer file in the directory (names and contents; weight files are not read), the template
family, ``trust_remote_code`` and the versions of Python, transformers, tokenizers and this package, so an edited
tokenizer file or an upgraded library is a cache miss, never a stale hit.

Where: ``$EAGLE3_TOKENIZER_CACHE``, else ``<tmp>/eagle3-data-<uid>/tokenizers`` (mode 0700: only this user's own
processes write what this user's processes unpickle; a directory owned by someone else or open to others is not
used). Beside each entry, ``<key>.facts.json`` holds what the validate checks ask of the tokenizer (its length,
the ids of the template family's special tokens, :func:`tokenizer_facts`), so a validate job answers them from a
:class:`LazyTokenizer` and loads the tokenizer only when a check decodes. A BPE model's merges are stored as
``"a b"`` strings (:func:`backend_json`, checked to rebuild the same tokenizer): about half the Rust load time
of the ``["a", "b"]`` form. ``EAGLE3_TOKENIZER_CACHE=off`` turns the cache off. A tokenizer that cannot be pickled (remote code) or a
cache entry that fails to load is loaded from its directory as before; a cache problem never fails a job.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import pickle
import stat
import sys
import tempfile
from pathlib import Path

log = logging.getLogger("eagle3_data.templates.tokenizer_cache")

CACHE_ENV = "EAGLE3_TOKENIZER_CACHE"
#: file suffixes never read for the key (model weights next to the tokenizer)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".onnx", ".ckpt", ".npz")
#: files above this size are keyed by size and modification time instead of content
MAX_HASHED_BYTES = 256 * 1024 * 1024
#: version of the entry layout (part of the key): 2 stores a fast tokenizer's BPE merges as ``"a b"`` strings
ENTRY_FORMAT = "2"


def cache_dir(env: dict | None = None) -> Path | None:
    """The cache directory (created 0700), or ``None`` when the cache is off or the directory is not safe to use
    (not owned by this user, or writable by others)."""
    env = os.environ if env is None else env
    d = env.get(CACHE_ENV)
    if d and d.lower() in ("off", "0", "false", "no"):
        return None
    path = Path(d) if d else Path(tempfile.gettempdir()) / f"eagle3-data-{os.getuid()}" / "tokenizers"
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        st = path.stat()
    except OSError as exc:
        log.debug("tokenizer cache off: %s: %s", path, exc)
        return None
    if st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        log.warning("tokenizer cache off: %s is not this user's private directory", path)
        return None
    return path


def cache_key(path, template: str, trust_remote_code: bool) -> str:
    """SHA-256 (hex) of the tokenizer directory's files (names + contents, weights skipped) and of the settings
    and library versions that shape the loaded object."""
    import tokenizers
    import transformers

    from .. import __version__

    h = hashlib.sha256()
    for part in (
        sys.version,
        transformers.__version__,
        tokenizers.__version__,
        __version__,
        template,
        str(bool(trust_remote_code)),
        ENTRY_FORMAT,
    ):
        h.update(part.encode() + b"\x00")
    root = Path(path)
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        if f.name.endswith(WEIGHT_SUFFIXES) or ".cache" in f.relative_to(root).parts:
            continue
        st = f.stat()
        h.update(str(f.relative_to(root)).encode() + b"\x00")
        if st.st_size > MAX_HASHED_BYTES:
            h.update(f"{st.st_size}:{st.st_mtime_ns}".encode())
            continue
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
        h.update(b"\x00")
    return h.hexdigest()


def load_tokenizer(path, template: str, trust_remote_code: bool, load, facts=None):
    """The tokenizer of directory ``path``: from the cache when an entry for its key exists, else ``load()``
    (stored in the cache for the next job). ``load``: a no-argument function returning the loaded tokenizer;
    its errors propagate unchanged. ``facts``: optional function of the loaded tokenizer returning its
    :func:`tokenizer_facts` (a JSON-able dict), stored beside the entry when missing, for :func:`cached_facts`."""
    d = cache_dir()
    if d is None:
        return load()
    try:
        key = cache_key(path, template, trust_remote_code)
    except OSError as exc:
        log.debug("tokenizer cache skipped for %s: %s", path, exc)
        return load()
    entry = d / f"{key}.pkl"
    if entry.is_file():
        try:
            with open(entry, "rb") as fh:
                tok = pickle.load(fh)
            log.debug("tokenizer of %s from the cache (%s)", path, entry.name[:12])
            _store_facts(d, key, tok, facts)
            return tok
        except Exception as exc:  # a truncated or incompatible entry: load from the directory, replace it
            log.warning("tokenizer cache entry %s unreadable (%s); loading %s", entry, exc, path)
    tok = load()
    _store_facts(d, key, tok, facts)
    try:
        data = dumps(tok)
        fd, tmp = tempfile.mkstemp(dir=d, prefix=f".{key[:12]}-", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            os.replace(tmp, entry)  # atomic: a concurrent job reads the old state or the whole entry
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except Exception as exc:  # remote-code tokenizers may not pickle; the cache is only an optimisation
        log.debug("tokenizer of %s not cached: %s", path, exc)
    return tok


def backend_json(backend) -> str:
    """``tokenizers.Tokenizer`` ``backend`` as the JSON text that rebuilds it fastest, checked to rebuild it exactly.

    A BPE model's merges are written as ``"a b"`` strings instead of ``["a", "b"]`` pairs when no merge part holds a
    space (true of byte-level BPE, whose vocabulary has no raw space): the Rust deserializer reads that form in about
    half the time (Qwen3's 151,669-token vocabulary: ~0.55 s instead of ~1.0 s on a loaded core), and a cached
    tokenizer is loaded by every tokenize and validate job. The rewritten text is kept only when the tokenizer it
    builds serializes back to exactly the original (``to_str()``), else the original text is returned.
    """
    from tokenizers import Tokenizer

    text = backend.to_str()
    data = json.loads(text)
    model = data.get("model") or {}
    merges = model.get("merges")
    if (
        model.get("type") != "BPE"
        or not merges
        or not all(
            isinstance(m, list) and len(m) == 2 and all(isinstance(x, str) and " " not in x for x in m) for m in merges
        )
    ):
        return text
    model["merges"] = [f"{a} {b}" for a, b in merges]
    compact = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    try:
        same = Tokenizer.from_str(compact).to_str() == text
    except Exception:  # noqa: BLE001 - any failure: keep the original form
        same = False
    return compact if same else text


def _backend_from_json(text: str):
    """Unpickling side of :func:`backend_json`: the ``tokenizers.Tokenizer`` of ``text``."""
    from tokenizers import Tokenizer

    return Tokenizer.from_str(text)


class _Pickler(pickle.Pickler):
    """Pickles every ``tokenizers.Tokenizer`` inside the object as its :func:`backend_json` text."""

    def reducer_override(self, obj):
        from tokenizers import Tokenizer

        if isinstance(obj, Tokenizer):
            return _backend_from_json, (backend_json(obj),)
        return NotImplemented


def dumps(tok) -> bytes:
    """The cache entry bytes of a loaded tokenizer (a pickle; its Rust half as :func:`backend_json` text).
    Raises what ``pickle`` raises for an object that can't be pickled (remote-code tokenizers may not)."""
    buf = io.BytesIO()
    _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(tok)
    return buf.getvalue()


#: tokenizer attributes a :class:`LazyTokenizer` answers from its facts (absent ones stay absent)
FACT_ATTRS = ("unk_token_id", "unk_token", "eos_token", "all_special_ids", "chat_template", "is_fast")


def tokenizer_facts(tok, names) -> dict:
    """What :class:`LazyTokenizer` answers without the tokenizer: ``len`` (``len(tok)``), ``ids`` (token name ->
    ``tok.convert_tokens_to_ids([name])[0]`` for every name in ``names`` and ``tok.eos_token``; ``None`` where
    the tokenizer returns it) and ``attrs`` (the :data:`FACT_ATTRS` ``tok`` has). All asked of ``tok`` itself,
    so a lazy answer is the tokenizer's own."""
    names = {n for n in names if isinstance(n, str)}
    eos = getattr(tok, "eos_token", None)
    if isinstance(eos, str):
        names.add(eos)
    ids = {n: tok.convert_tokens_to_ids([n])[0] for n in sorted(names)}
    attrs = {}
    for a in FACT_ATTRS:
        try:
            attrs[a] = getattr(tok, a)
        except AttributeError:
            continue
    if isinstance(attrs.get("all_special_ids"), (list, tuple)):
        attrs["all_special_ids"] = [int(x) for x in attrs["all_special_ids"]]
    return {"len": len(tok), "ids": {n: None if i is None else int(i) for n, i in ids.items()}, "attrs": attrs}


def _store_facts(d: Path, key: str, tok, facts) -> None:
    """Write ``facts(tok)`` as ``<key>.facts.json`` in cache dir ``d`` when missing (atomic; never raises)."""
    if facts is None:
        return
    entry = d / f"{key}.facts.json"
    if entry.is_file():
        return
    try:
        text = json.dumps(facts(tok))
        fd, tmp = tempfile.mkstemp(dir=d, prefix=f".{key[:12]}-", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as fh:
                fh.write(text)
            os.replace(tmp, entry)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except Exception as exc:  # noqa: BLE001 - a template not JSON-able, a full disk: no facts, a full load later
        log.debug("tokenizer facts of %s not cached: %s", key[:12], exc)


def cached_facts(path, template: str, trust_remote_code: bool) -> dict | None:
    """The :func:`tokenizer_facts` stored for directory ``path`` (same key as :func:`load_tokenizer`), or
    ``None`` when the cache is off, the directory changed, or no job stored them yet. Never raises."""
    d = cache_dir()
    if d is None:
        return None
    try:
        entry = d / f"{cache_key(path, template, trust_remote_code)}.facts.json"
        if not entry.is_file():
            return None
        with open(entry) as fh:
            facts = json.load(fh)
        return facts if {"len", "ids", "attrs"} <= set(facts) else None
    except (OSError, ValueError) as exc:
        log.debug("tokenizer facts of %s unreadable: %s", path, exc)
        return None


class LazyTokenizer:
    """A stand-in for a loaded tokenizer that answers ``len()``, ``convert_tokens_to_ids`` of the names in its
    facts and the :data:`FACT_ATTRS` from :func:`tokenizer_facts`, and loads the real tokenizer (``load()``, once)
    on any other use: a validate job whose checks need no encode or decode never pays the ~0.5-1 s load of a
    large vocabulary. Every answer equals the real tokenizer's (the facts were asked of it)."""

    def __init__(self, facts: dict, load):
        self._facts = facts
        self._load = load
        self._tok = None

    @property
    def loaded(self) -> bool:
        """Whether the real tokenizer has been loaded."""
        return self._tok is not None

    def real(self):
        """The real tokenizer (loaded on the first call)."""
        if self._tok is None:
            self._tok = self._load()
        return self._tok

    def __len__(self) -> int:
        return int(self._facts["len"]) if self._tok is None else len(self._tok)

    def convert_tokens_to_ids(self, tokens):
        ids = self._facts["ids"]
        if self._tok is None:
            if isinstance(tokens, str) and tokens in ids:
                return ids[tokens]
            if isinstance(tokens, (list, tuple)) and all(isinstance(t, str) and t in ids for t in tokens):
                return [ids[t] for t in tokens]
        return self.real().convert_tokens_to_ids(tokens)

    def __getattr__(self, name):
        if name.startswith("__") or name in ("_facts", "_load", "_tok"):
            raise AttributeError(name)
        if self._tok is None and name in FACT_ATTRS:
            attrs = self._facts["attrs"]
            if name not in attrs:
                raise AttributeError(name)
            return attrs[name]
        return getattr(self.real(), name)
