"""Checks before any job runs (``rules/common.smk``, also on a dry run): what would otherwise be found only after
paying for responses.

- the target's tokenizer and chat template load from ``target.path`` (tokenize needs both; without them every paid
  response would be lost at tokenize). A cheap look at the directory's files first (no ``transformers`` import),
  then one real load (:func:`eagle3_data.templates.load_target_tokens`), whose success is remembered under
  ``<cache_dir>/checks/`` for the directory's current files, so later parses skip it;
- ``vocab.draft_vocab_size`` fits the target's vocabulary (``vocab_size`` of ``target.path/config.json``);
- every ``launch.python`` of a backend in use exists (:func:`eagle3_data.backends.server.launch_python`);
- the states extraction will store can serve every ``export.layouts`` layout (:func:`check_export_layouts`): the
  final-state form it reads (``extract.final_norm``) and its drafter's layers (``extract.drafters``; the layers
  fit the target when its ``config.json`` is there), so a conflict is found before any GPU hour is spent;
- a dataset with image prompts runs only on stages that take images (:func:`check_image_prompts`);
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

from ..config import ConfigError, backends_config, generated_datasets

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
        raise ConfigError(
            f"Config error: target.path: {path or '(empty)'} does not exist; it must be a local "
            "directory with the target model's tokenizer and chat template (download a Hub model "
            "first, e.g. `hf download <repo> --local-dir <dir>`), checked before any "
            "request is paid for."
        )
    if not d.is_dir():
        raise ConfigError(f"Config error: target.path: {path} is a file, not the directory of the target's tokenizer.")
    if not any((d / f).is_file() for f in TOKENIZER_FILES) and not any(d.glob("*.tiktoken")):
        raise ConfigError(
            f"Config error: target.path: {path} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); "
            "point it at the target model's directory."
        )
    if not _has_chat_template(d):
        raise ConfigError(
            f"Config error: target.path: {path} has no chat template (chat_template.jinja, or "
            "chat_template in tokenizer_config.json): tokenize renders every prompt with it."
        )
    if not load or target.get("build_tiny"):  # a tiny target: made by this build, with its template
        return
    stamp = Path(cache_dir) / "checks" / f"target-{_signature(d, target)}.ok" if cache_dir is not None else None
    if stamp is not None and stamp.exists():
        return
    from ..templates import TemplateError, load_target_tokens

    try:
        load_target_tokens(
            path, target.get("template", "generic"), trust_remote_code=bool(target.get("trust_remote_code", False))
        )
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
    from ..vocab import target_vocab_size

    try:
        size = target_vocab_size(path)
    except (KeyError, ValueError, OSError):
        return
    if int(draft) > size:
        raise ConfigError(
            f"Config error: vocab.draft_vocab_size is {int(draft):,}, larger than the target's "
            f"vocabulary ({size:,} tokens, vocab_size of {path}/config.json); set it to at most "
            f"{size:,}."
        )


def image_datasets(config: dict) -> list[str]:
    """Datasets that read image prompts: source format ``llava``, or ``source.options.image_dir`` set."""
    out = []
    for name, ds in (config.get("datasets") or {}).items():
        source = (ds or {}).get("source") or {}
        if source.get("format") == "llava" or (source.get("options") or {}).get("image_dir") is not None:
            out.append(name)
    return out


def check_image_prompts(config: dict) -> None:
    """A build with image prompts (:func:`image_datasets`) runs only where every stage can take them: the target's
    states come from ``extract.backend: transformers`` (the SGLang extraction backend takes token ids only), and no
    backend of such a dataset sends SGLang's native ``/generate`` (token ids, no pictures). A target without an
    image processor is found at tokenize (reject ``image_prompt_text_target``). Raises ConfigError naming the
    dataset and the key."""
    names = image_datasets(config)
    if not names:
        return
    backend = ((config.get("extract") or {}).get("backend")) or "transformers"
    if backend != "transformers":
        raise ConfigError(
            f"Config error: datasets.{names[0]} holds image prompts, and extract.backend {backend!r} takes token ids "
            "only: set extract.backend: transformers (it passes the images through the target's vision tower)"
        )
    for name in names:
        if name not in generated_datasets(config):
            continue
        for b_name, b in backends_config(config, name).items():
            if (b or {}).get("native_generate"):
                raise ConfigError(
                    f"Config error: datasets.{name} holds image prompts and its backend {b_name} sends SGLang's "
                    f"native /generate (token ids, no pictures): set backends.{b_name}.native_generate: false"
                )


def check_launch_python(config: dict) -> None:
    """Every ``backends.<name>.launch.python`` of a backend a generated dataset uses exists. Raises ConfigError."""
    seen = set()
    for ds in generated_datasets(config):
        for name, b in backends_config(config, ds).items():
            launch = (b or {}).get("launch") or {}
            if name in seen or not launch.get("python"):
                continue
            seen.add(name)
            from ..backends.server import ServerLaunchError, launch_python

            try:
                launch_python(launch)
            except ServerLaunchError as exc:
                raise ConfigError(f"Config error: backends.{name}.{exc.message}; {exc.hint}.") from None


#: what each final_norm setting lets an export read
_FORMS = {"both": ("post", "pre"), "post": ("post",), "pre": ("pre",)}
_DRAFTER_NAMES = {
    "eagle3": "EAGLE-3's auxiliary layers",
    "dflash": "DFlash's target layers",
    "dspark": "DSpark's target layers",
}


def check_export_layouts(config: dict) -> None:
    """Every ``export.layouts`` layout can be written from the states ``extract`` will store
    (:data:`eagle3_data.export.CONTRACTS`): the final-state form it reads is one ``extract.final_norm`` keeps, and
    ``extract.drafters`` includes a drafter whose layers it reads; ``extract.backend: sglang`` stores post-norm
    final states only. With the target's ``config.json`` present the drafters' layers are resolved against it.
    Raises ConfigError naming the setting to change."""
    from ..config import section
    from ..export import CONTRACTS

    ext, layouts = section(config, "extract"), section(config, "export")["layouts"] or []
    norm, drafters = ext["final_norm"], list(ext["drafters"] or ["eagle3"])
    if ext["backend"] == "sglang" and norm != "post":
        raise ConfigError(
            f"Config error: extract.backend sglang stores post-norm final states only, but "
            f"extract.final_norm is {norm}; set extract.final_norm: post (or use extract.backend: "
            "transformers, which stores both forms)"
        )
    for layout in layouts:
        c = CONTRACTS[layout]
        if c["final"] is not None and c["final"] not in _FORMS[norm]:
            fix = (
                "use extract.backend: transformers with extract.final_norm: both"
                if ext["backend"] == "sglang"
                else f"set extract.final_norm: both (the default: every layout from one extraction) or {c['final']}"
            )
            raise ConfigError(
                f"Config error: export.layouts: {layout} reads {c['final']}-norm final states, but "
                f"extract.final_norm: {norm} stores {norm}-norm ones only; {fix}"
            )
        if not set(c["drafters"]) & set(drafters):
            want = c["drafters"][0]
            raise ConfigError(
                f"Config error: export.layouts: {layout} reads {_DRAFTER_NAMES[want]}, which "
                f"extract.drafters {drafters} does not capture; add {want} to extract.drafters"
            )
    path = Path(str((config.get("target") or {}).get("path") or "")) / "config.json"
    if path.is_file():
        from ..extract.model import model_dims, resolve_drafter_layers

        try:
            L = model_dims(path)["num_layers"]
        except (KeyError, ValueError, OSError):
            return
        try:
            resolve_drafter_layers(drafters, ext["layers"], ext["dflash_layers"], L)
        except ValueError as exc:
            raise ConfigError(f"Config error: {exc} (target {path.parent}, {L} decoder layers)") from None


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
                    f"write the value into the profile, then run again."
                )


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
    check_export_layouts(config)
    check_image_prompts(config)
    check_launch_python(config)
    if workflow is not None:
        check_resources(cluster_resources(workflow))
