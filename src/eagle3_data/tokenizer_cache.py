"""A local on-disk cache of loaded target tokenizers, so a shard's tokenize and validate jobs (and every other
shard's) load the target tokenizer from its directory once per machine instead of once per job.

``AutoTokenizer.from_pretrained`` of a large vocabulary (Qwen3's 151,669 tokens) costs seconds per job: transformers
rebuilds its added-token tables and probes the pipeline (``templates._as_shipped``). The cache stores the loaded
tokenizer object (pickled; a fast tokenizer's Rust half is stored as its ``tokenizer.json`` text) under a key made of
the SHA-256 of every tokenizer file in the directory (names and contents; weight files are not read), the template
family, ``trust_remote_code`` and the versions of Python, transformers, tokenizers and this package, so an edited
tokenizer file or an upgraded library is a cache miss, never a stale hit.

Where: ``$EAGLE3_TOKENIZER_CACHE``, else ``<tmp>/eagle3-data-<uid>/tokenizers`` (mode 0700: only this user's own
processes write what this user's processes unpickle; a directory owned by someone else or open to others is not
used). ``EAGLE3_TOKENIZER_CACHE=off`` turns the cache off. A tokenizer that cannot be pickled (remote code) or a
cache entry that fails to load is loaded from its directory as before; a cache problem never fails a job.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import stat
import sys
import tempfile
from pathlib import Path

log = logging.getLogger("eagle3_data.tokenizer_cache")

CACHE_ENV = "EAGLE3_TOKENIZER_CACHE"
#: file suffixes never read for the key (model weights next to the tokenizer)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".onnx", ".ckpt", ".npz")
#: files above this size are keyed by size and modification time instead of content
MAX_HASHED_BYTES = 256 * 1024 * 1024


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

    from . import __version__

    h = hashlib.sha256()
    for part in (sys.version, transformers.__version__, tokenizers.__version__, __version__, template,
                 str(bool(trust_remote_code))):
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


def load_tokenizer(path, template: str, trust_remote_code: bool, load):
    """The tokenizer of directory ``path``: from the cache when an entry for its key exists, else ``load()``
    (stored in the cache for the next job). ``load``: a no-argument function returning the loaded tokenizer;
    its errors propagate unchanged."""
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
            return tok
        except Exception as exc:  # a truncated or incompatible entry: load from the directory, replace it
            log.warning("tokenizer cache entry %s unreadable (%s); loading %s", entry, exc, path)
    tok = load()
    try:
        data = pickle.dumps(tok, protocol=pickle.HIGHEST_PROTOCOL)
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
