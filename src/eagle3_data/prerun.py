"""Checks before any job runs (``rules/common.smk``, also on a dry run): what would otherwise be found only after
paying for responses.

- the target's tokenizer and chat template load from ``target.path`` (tokenize needs both; without them every paid
  response would be lost at tokenize). A cheap look at the directory's files first (no ``transformers`` import),
  then one real load (:func:`eagle3_data.templates.load_target_tokens`), whose success is remembered under
  ``<cache_dir>/checks/`` for the directory's current files, so later parses skip it;
- ``vocab.draft_vocab_size`` fits the target's vocabulary (``vocab_size`` of ``target.path/config.json``);
- every ``launch.python`` of a backend in use exists (:func:`eagle3_data.backends.server.launch_python`);
- cluster resources (the SLURM profile's ``slurm_account: "$EAGLE3_SLURM_ACCOUNT"``) hold no ``$VARIABLE`` left
  unexpanded because the variable is not set (Snakemake would submit the literal text).

A target the build makes itself (``target.build_tiny``, ``target.gguf``: its rule writes the directory) is not
checked here (a GGUF file's presence is a config check). Each check raises
:class:`eagle3_data.config.ConfigError` with a one-line message naming the key and what to do.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

from .config import ConfigError, backends_config, generated_datasets

#: files of which one must be in a tokenizer directory (fast tokenizer, sentencepiece, tiktoken, BPE vocab)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tiktoken.model", "vocab.json", "tokenizer_config.json")
_VAR = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?")


def _has_chat_template(d: Path) -> bool:
    if (d / "chat_template.jinja").is_file() or (d / "chat_template.json").is_file():
        return True
    if (d / "additional_chat_templates").is_dir():
        return True
    try:
        return bool(json.loads((d / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return False


def _signature(d: Path, target: dict) -> str:
    """A digest of the directory's top-level files (name, size, mtime) and the target settings the load uses."""
    items = []
    for p in sorted(d.iterdir()):
        if p.is_file():
            st = p.stat()
            items.append((p.name, st.st_size, st.st_mtime_ns))
    key = [str(d.resolve()), items, bool(target.get("trust_remote_code")), target.get("template", "generic")]
    return hashlib.sha256(json.dumps(key).encode()).hexdigest()[:24]


def check_target(config: dict, cache_dir: str | os.PathLike | None = None, *, load: bool = True) -> None:
    """``target.path`` holds a tokenizer with a chat template (see the module docstring); ``load``: also load it
    once with transformers (remembered under ``<cache_dir>/checks/``). Raises ConfigError."""
    target = config.get("target") or {}
    path = str(target.get("path") or "")
    d = Path(path)
    if target.get("build_tiny") or target.get("gguf"):
        return  # the build makes (and remakes) it: rule tiny_target or gguf_target
    if not path or not d.exists():
        raise ConfigError(f"Config error: target.path: {path or '(empty)'} does not exist; it must be a local "
                          "directory with the target model's tokenizer and chat template (download a Hub model "
                          "first, e.g. `hf download <repo> --local-dir <dir>`), checked before any "
                          "request is paid for.")
    if not d.is_dir():
        raise ConfigError(f"Config error: target.path: {path} is a file, not the directory of the target's tokenizer.")
    if not any((d / f).is_file() for f in TOKENIZER_FILES) and not any(d.glob("*.tiktoken")):
        raise ConfigError(f"Config error: target.path: {path} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); "
                          "point it at the target model's directory.")
    if not _has_chat_template(d):
        raise ConfigError(f"Config error: target.path: {path} has no chat template (chat_template.jinja, or "
                          "chat_template in tokenizer_config.json): tokenize renders every prompt with it.")
    if not load or target.get("build_tiny"):  # a tiny target: made by this build, with its template
        return
    stamp = Path(cache_dir) / "checks" / f"target-{_signature(d, target)}.ok" if cache_dir is not None else None
    if stamp is not None and stamp.exists():
        return
    from .templates import TemplateError, load_target_tokens

    try:
        load_target_tokens(path, target.get("template", "generic"),
                           trust_remote_code=bool(target.get("trust_remote_code", False)))
    except (TemplateError, ValueError) as exc:
        raise ConfigError(f"Config error: target.path: {' '.join(str(exc).split())[:400]}") from None
    if stamp is not None:
        try:
            stamp.parent.mkdir(parents=True, exist_ok=True)
            stamp.write_text(path + "\n")
        except OSError:
            pass


def check_draft_vocab(config: dict) -> None:
    """``vocab.draft_vocab_size`` <= the target's ``vocab_size`` (its ``config.json``; nothing to check without
    one). Raises ConfigError."""
    draft = (config.get("vocab") or {}).get("draft_vocab_size")
    path = Path(str((config.get("target") or {}).get("path") or ""))
    if draft is None or not (path / "config.json").is_file():
        return
    from .vocab import target_vocab_size

    try:
        size = target_vocab_size(path)
    except (KeyError, ValueError, OSError):
        return
    if int(draft) > size:
        raise ConfigError(f"Config error: vocab.draft_vocab_size is {int(draft):,}, larger than the target's "
                          f"vocabulary ({size:,} tokens, vocab_size of {path}/config.json); set it to at most "
                          f"{size:,}.")


def check_launch_python(config: dict) -> None:
    """Every ``backends.<name>.launch.python`` of a backend a generated dataset uses exists. Raises ConfigError."""
    seen = set()
    for ds in generated_datasets(config):
        for name, b in backends_config(config, ds).items():
            launch = (b or {}).get("launch") or {}
            if name in seen or not launch.get("python"):
                continue
            seen.add(name)
            from .backends.server import ServerLaunchError, launch_python

            try:
                launch_python(launch)
            except ServerLaunchError as exc:
                raise ConfigError(f"Config error: backends.{name}.{exc.message}; {exc.hint}.") from None


def check_resources(resources: dict, where: str = "default-resources", environ=None) -> None:
    """No resource value (e.g. the SLURM profile's ``slurm_account: "$EAGLE3_SLURM_ACCOUNT"``) names an
    environment variable that is not set. ``resources``: name -> value as the profile gave it. Raises
    ConfigError naming the resource and the variable."""
    env = os.environ if environ is None else environ
    for name, value in (resources or {}).items():
        if not isinstance(value, str):
            continue
        for var in _VAR.findall(value):
            if not env.get(var):
                raise ConfigError(
                    f"Profile error: {where} {name} is {value!r} but {var} is not set (the job would be submitted "
                    f"with the literal text); export {var}=<value> (for slurm_account: your cluster account) or "
                    f"write the value into the profile, then run again.")


def cluster_resources(workflow) -> dict:
    """The default resources of a Snakemake ``workflow`` as the profile wrote them (name -> text; Snakemake
    evaluates them later), {} if unknown."""
    res = getattr(getattr(workflow, "resource_settings", None), "default_resources", None)
    data = getattr(res, "_data", None)
    if not isinstance(data, dict):
        return {}
    return {k: r.raw for k, r in data.items() if isinstance(getattr(r, "raw", None), str)}


def check_before_run(config: dict, *, cache_dir=None, workflow=None, load_target: bool = True) -> None:
    """All the checks of the module docstring; ``workflow``: the Snakemake workflow (its default resources are
    checked; a dry run does not say which executor the run would use, so every profile's are). Raises
    ConfigError."""
    check_target(config, cache_dir, load=load_target)
    check_draft_vocab(config)
    check_launch_python(config)
    if workflow is not None:
        check_resources(cluster_resources(workflow))
