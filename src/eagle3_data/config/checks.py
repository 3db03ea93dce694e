"""The checks run before any job: cross-key checks the schema can't express, config layering, API keys, and
``target.template: auto`` resolved."""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from .lookup import (
    ORIGINAL_BACKEND,
    answers_of,
    backends_config,
    datasets,
    generated_datasets,
    generation_config,
    generation_source,
    is_original,
    is_pretokenized,
    merge_datasets,
    original_datasets,
    shard_names,
)
from .validation import ConfigError, yaml_keys


#: the completion family of the demo's tiny target (``target.build_tiny``; :mod:`eagle3_data.tiny_target`)
TINY_TARGET_FAMILY = "kimi-k25"
#: ... and of each ``target.tiny.kind`` (the tiny Qwen2.5-VL: ChatML without think markers)
TINY_TARGET_FAMILIES = {"kimi": TINY_TARGET_FAMILY, "qwen2.5-vl": "generic"}


def resolve_target_template(config: dict) -> str | None:
    """Replace ``target.template: auto`` in ``config`` by the family found from the target's own chat template
    (:func:`eagle3_data.templates.auto.resolve_template`, cached under ``cache_dir``: a cache hit imports no
    transformers) and return the line saying which was chosen and why; a named family is kept (an override;
    returns None). A tiny target not built yet (``build_tiny``) takes its kind's :data:`TINY_TARGET_FAMILIES`; a GGUF target not
    converted yet (``target.gguf``) is probed on the GGUF file's tokenizer (saved once under ``cache_dir``). Raises
    :class:`ConfigError` naming the property of the template that failed, or a missing ``target.path``.
    """
    from ..templates import TemplateError
    from ..templates.auto import describe, resolve_template

    target = config.get("target") or {}
    if (
        (target.get("template") or "auto") == "auto"
        and target.get("build_tiny")
        and not Path(str(target.get("path", ""))).exists()
    ):
        family = TINY_TARGET_FAMILIES[(target.get("tiny") or {}).get("kind") or "kimi"]
        target["template"] = family
        return f"target.template: auto -> {family} (the tiny target, built by rule tiny_target)"
    probe = target
    if (
        (target.get("template") or "auto") == "auto"
        and target.get("gguf")
        and not Path(str(target.get("path", ""))).exists()
    ):  # not converted yet: the GGUF file's own tokenizer
        from ..gguf_target import gguf_file, gguf_tokenizer_dir

        probe = {
            **target,
            "path": str(gguf_tokenizer_dir(gguf_file(target["gguf"]), config.get("cache_dir") or "cache")),
        }
    try:
        family, info = resolve_template(probe, config.get("cache_dir"))
    except TemplateError as exc:
        raise ConfigError(f"target.template: {exc}") from None
    target["template"] = family
    return None if info["source"] == "named" else describe(info)


def check_config(config: dict, *, check_paths: bool = True) -> None:
    """Cross-key checks the JSON schema can't express; raises :class:`ConfigError` naming the key.

    Backend names in ``generation.backends`` and every ``datasets.<name>.generation.backends`` must be defined,
    and every generated dataset must have one (an ``answers: original`` dataset needs none; it can't be
    pre-tokenized, and no backend may then be named ``original``, its answers' label); dataset names in
    ``merge.datasets``, ``merge.max_samples`` and ``plan.drop`` must exist. With ``check_paths``: every ``datasets.<name>.source.path`` must exist (Snakemake
    would otherwise keep using the outputs of an earlier build when a source path is changed to a missing file),
    and with ``target.build_tiny`` the ``target.path`` must be absent or a tiny target built earlier (the build
    replaces that directory; it must never be a real model's). ``target.gguf``: see :func:`_check_gguf`.
    """
    defined = sorted(config.get("backends") or {})
    for name in (config.get("generation") or {}).get("backends") or []:
        if name not in defined:
            raise ConfigError(f"generation.backends: unknown backend {name!r}; defined: {defined}")
    names = datasets(config)
    if original_datasets(config) and ORIGINAL_BACKEND in defined:
        raise ConfigError(
            f"backends.{ORIGINAL_BACKEND}: the name is reserved for the answers of the datasets with "
            f"answers: original ({', '.join(original_datasets(config))}) in the responses and reports; "
            "rename the backend"
        )
    for ds in names:
        if is_pretokenized(config, ds) and answers_of(config["datasets"][ds]) == "original":
            raise ConfigError(
                f"datasets.{ds}.answers: original needs a conversation source, but source.format is "
                "pretokenized (its token ids are trained on as they are); remove answers"
            )
        try:
            used = backends_config(config, ds)
        except KeyError as exc:
            raise ConfigError(exc.args[0]) from None
        if not used and not is_pretokenized(config, ds) and not is_original(config, ds):
            raise ConfigError(
                f"datasets.{ds}: no backend to generate its responses with; set generation.backends "
                f"(for every dataset) or datasets.{ds}.generation.backends (or datasets.{ds}.answers: "
                "original to train on the source's own answers)"
            )
        path = config["datasets"][ds]["source"]["path"]
        if check_paths and not Path(path).exists():
            raise ConfigError(f"datasets.{ds}.source.path: {path} does not exist")
        _check_template_kwargs(config, ds, used)
        if not is_pretokenized(config, ds) and not is_original(config, ds):
            _check_budgets(config, ds, used)
    _check_budgets(config, None, {})
    try:
        merge_datasets(config)
    except KeyError as exc:
        raise ConfigError(exc.args[0]) from None
    for key, given in (
        ("merge.max_samples", (config.get("merge") or {}).get("max_samples") or {}),
        ("plan.drop", (config.get("plan") or {}).get("drop") or []),
    ):
        unknown = [d for d in given if d not in names]
        if unknown:
            raise ConfigError(f"{key}: unknown dataset(s) {unknown}; defined: {names}")
    _check_benchmarks(config, check_paths)
    target = config.get("target") or {}
    tpath = Path(str(target.get("path", "")))
    if check_paths and target.get("build_tiny") and tpath.exists() and not (tpath / "tiny_target.json").exists():
        raise ConfigError(
            f"target.path: {tpath} exists and is not a tiny target this build made, but "
            "target.build_tiny is true (the build would replace it); set target.build_tiny: false "
            "for a real model"
        )
    if target.get("gguf"):
        _check_gguf(target, check_paths)


def _check_benchmarks(config: dict, check_paths: bool) -> None:
    """``decontaminate.benchmarks``: distinct names, ``field`` on a generic one, and (``check_paths``) each file
    there (:func:`eagle3_data.decontaminate.benchmark_path`: a path, or a path in an installed package)."""
    from ..decontaminate.benchmarks import BenchmarkError, benchmark_path

    entries = (config.get("decontaminate") or {}).get("benchmarks") or []
    names = [e.get("name") for e in entries]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"decontaminate.benchmarks: the name(s) {twice} are used twice; give each benchmark its own")
    for e in entries:
        if e.get("format") == "generic" and not e.get("field"):
            raise ConfigError(
                f"decontaminate.benchmarks {e.get('name')!r}: format generic needs `field` (the "
                "prompt's field in each record)"
            )
        if check_paths:
            try:
                benchmark_path(e)
            except BenchmarkError as exc:
                raise ConfigError(f"Config error: {exc}") from None


def _check_gguf(target: dict, check_paths: bool) -> None:
    """``target.gguf``: not with ``build_tiny``; with ``check_paths`` its file exists
    (:func:`eagle3_data.gguf_target.gguf_file`) and ``target.path`` is absent or a directory rule gguf_target made
    (the build replaces it). Raises :class:`ConfigError`."""
    from ..gguf_target import MARKER, gguf_file

    if target.get("build_tiny"):
        raise ConfigError(
            "Config error: target.gguf and target.build_tiny are both set: the target is either built "
            "from a GGUF file or the demo's tiny one; remove one of them."
        )
    if not check_paths:
        return
    gguf_file(target["gguf"])
    tpath = Path(str(target.get("path", "")))
    if tpath.exists() and not (tpath / MARKER).is_file():
        raise ConfigError(
            f"Config error: target.path: {tpath} exists and was not built from a GGUF file by this "
            "build, but target.gguf is set (rule gguf_target would replace it); point target.path at "
            "a new directory, or remove target.gguf to use that one as it is."
        )


def _check_template_kwargs(config: dict, ds: str, used: dict) -> None:
    """Raise :class:`ConfigError` when a backend would render the prompts of ``ds`` with chat-template variables
    other than the ones tokenize renders them with.

    tokenize renders with ``target.chat_template_kwargs`` updated by the dataset's
    ``generation.extra_body.chat_template_kwargs``; a backend's server receives the dataset's
    ``chat_template_kwargs`` when it sets them (the request's ``extra_body`` replaces the backend's), else the
    backend's own ``extra_body.chat_template_kwargs``. A variable the server gets with another value than tokenize
    uses (e.g. ``thinking: false`` on the backend, ``thinking: true`` on the target) would make every prompt's
    ids differ from what the target saw. A variable tokenize uses but the server is not sent is allowed (the
    server's template default, e.g. OpenRouter's, is the user's to know). A ``native_generate`` backend is sent
    the prompt's ids, rendered as tokenize renders them. An ``answers: original`` dataset sends nothing."""
    if is_pretokenized(config, ds) or is_original(config, ds):
        return
    target_kw = dict((config.get("target") or {}).get("chat_template_kwargs") or {})
    ds_extra = generation_config(config, ds).get("extra_body") or {}
    rendered = {**target_kw, **(ds_extra.get("chat_template_kwargs") or {})}
    for name, b in used.items():
        if (b or {}).get("native_generate"):  # the prompt ids are rendered here, as tokenize renders them
            continue
        if "chat_template_kwargs" in ds_extra:
            sent, where = ds_extra["chat_template_kwargs"] or {}, f"datasets.{ds}.generation.extra_body"
        else:
            sent, where = (
                ((b or {}).get("extra_body") or {}).get("chat_template_kwargs") or {},
                f"backends.{name}.extra_body",
            )
        for k, v in sent.items():
            if rendered.get(k, None) != v:
                have = f"{rendered[k]!r} (target.chat_template_kwargs)" if k in rendered else "not set"
                raise ConfigError(
                    f"{where}.chat_template_kwargs.{k} is {v!r}, but tokenize renders the prompts of {ds} with {k} "
                    f"{have}: the token ids would not be the prompt the target saw. Set target.chat_template_kwargs."
                    f"{k} to {v!r} too (or set it in datasets.{ds}.generation.extra_body.chat_template_kwargs, which "
                    "both use)"
                )


def config_sources(
    paths: Sequence[str | os.PathLike], default: str | os.PathLike | None = None
) -> list[tuple[str, dict]]:
    """The config files a run merges, as ``(path, parsed YAML)`` in merge order (paths under the working directory
    shown relative to it).

    ``paths``: the ``--configfile`` arguments (Snakemake's ``workflow.overwrite_configfiles``); none given: the
    embedded ``default``. A file that can't be read or parsed is left out (Snakemake reports it itself). Raises
    :class:`ConfigError` for a key set twice in one mapping (naming the file and both lines): YAML would keep the
    last one silently.
    """
    import yaml

    names = [str(p) for p in paths] or ([str(default)] if default is not None else [])
    out = []
    for name in names:
        try:
            text = Path(name).read_text()
            tree = yaml.safe_load(text)
            _, dups = yaml_keys(text)
        except (OSError, yaml.YAMLError, ValueError):
            continue
        shown = os.path.relpath(name) if os.path.isabs(name) else name
        shown = name if shown.startswith("..") else shown
        if dups:
            path, first, second = dups[0]
            raise ConfigError(
                f"Config error in {shown}: {'.'.join(map(str, path))} is set twice, at lines {first} and {second}; "
                f"YAML keeps only the one at line {second} and silently drops the other (e.g. a budget): merge them "
                "into one"
            )
        out.append((shown, tree if isinstance(tree, dict) else {}))
    return out


def check_layering(files: Sequence[tuple[str, dict]]) -> None:
    """Refuse a merge of several config files that would build datasets the user did not mean to.

    Snakemake merges ``--configfile a.yaml b.yaml`` key by key, so the datasets of ``a.yaml`` are kept next to
    ``b.yaml``'s and get ``b.yaml``'s target and backends (e.g. the demo's datasets sent to a paid endpoint).
    Rule: a file that is a config of its own (it sets ``target`` or ``backends``, and defines datasets of its
    own: entries with a ``source``) must name every dataset defined by the files before it; naming one
    (``name: {}`` keeps it as it is) is how to keep it. Files that only add datasets or change keys
    (``merge.max_len: 512``, ``datasets.x.shards: 4``) layer as usual.
    Raises :class:`ConfigError` naming both files and the datasets.
    """
    defined_by: dict[str, str] = {}
    for name, tree in files:
        entries = tree.get("datasets") if isinstance(tree.get("datasets"), dict) else {}
        own = [ds for ds, e in entries.items() if isinstance(e, dict) and "source" in e and ds not in defined_by]
        earlier = [ds for ds in defined_by if ds not in entries]
        if own and earlier and ({"target", "backends"} & set(tree)):
            origins = sorted({defined_by[ds] for ds in earlier})
            raise ConfigError(
                f"Config error: {name} is a config of its own (target or backends, and datasets), so the datasets "
                f"of {', '.join(origins)} ({', '.join(earlier)}) would be built too, with its target and backends "
                f"(--configfile files are merged key by key). Use {name} alone (keys it leaves out take their "
                f"defaults), or name in it each dataset to keep (e.g. `{earlier[0]}: {{}}`)."
            )
        for ds in own:
            defined_by[ds] = name


def pending_generation(config: dict, root: str | os.PathLike = ".") -> list[str]:
    """Generated datasets with a responses shard not written yet under ``root/results/`` (those that will send
    requests; a dataset whose responses all exist needs no API key for a rerun of later stages)."""
    root = Path(root)
    return [
        ds
        for ds in generated_datasets(config)
        if not all((root / f"results/{ds}/responses/{s}.parquet").exists() for s in shard_names(config, ds))
    ]


def _check_budgets(config: dict, ds: str | None, used: dict) -> None:
    """The budgets of ``ds`` (None: the global ``generation`` defaults) are real caps: finite and >= 0, and a
    ``budget_usd`` only with backends whose replies can be costed (:func:`eagle3_data.generate.budget.uncosted_backends`).
    Raises :class:`ConfigError` naming the setting."""
    from ..generate.budget import bad_budget, uncosted_backends

    gen = generation_config(config, ds) if ds else (config.get("generation") or {})
    for key in ("budget_usd", "budget_completion_tokens"):
        why = bad_budget(gen.get(key))
        if why:
            where = generation_source(config, ds, key) if ds else f"generation.{key}"
            raise ConfigError(f"{where} {why}: set a finite number >= 0, or null for no budget")
    uncosted = uncosted_backends(used) if gen.get("budget_usd") is not None else []
    if uncosted:
        b = uncosted[0]
        raise ConfigError(
            f"{generation_source(config, ds, 'budget_usd')} is set, but backend {b} (type "
            f"{config['backends'][b].get('type')}, used by {ds}) reports no cost and has no price, so the budget "
            f"could not count what it spends: set backends.{b}.price_per_m: {{prompt: USD, completion: USD}} (per "
            "million tokens; 0 for a free local server), or remove budget_usd"
        )


def check_api_keys(config: dict, dataset_names: Iterable[str], environ: Mapping[str, str] | None = None) -> None:
    """Every ``api_key_env`` of the backends that ``dataset_names`` generate with must be set (non-empty), to a
    key of at least :data:`eagle3_data.backends.paid.MIN_KEY_CHARS` characters.

    Raises :class:`ConfigError` naming each missing variable, the backend and datasets using it, and any set
    variable with a close name (a typo or another spelling); or a key too short. Never reads out a value.
    """
    env = os.environ if environ is None else environ
    users: dict[str, list[str]] = {}
    for ds in dataset_names:
        for name in backends_config(config, ds):
            users.setdefault(name, []).append(ds)
    from ..backends.paid import short_key_problem

    lines = []
    for name, dss in users.items():
        var = (config["backends"][name] or {}).get("api_key_env")
        short = short_key_problem(var, env[var].strip()) if var and env.get(var) else None
        if short:
            raise ConfigError(f"Config error: backends.{name}.api_key_env: {short}.")
        if not var or env.get(var):
            continue
        close = _close_names(var, [k for k, v in env.items() if v])
        also = f"; set, with a close name: {', '.join(close)}" if close else ""
        lines.append(f"{var} is not set (backends.{name}.api_key_env, used by {', '.join(dss)}){also}")
    if not lines:
        return
    todo = "export the key under the name the config gives (or correct api_key_env), then run again"
    if len(lines) == 1:
        raise ConfigError(f"Config error: {lines[0]}. {todo[0].upper() + todo[1:]}.")
    raise ConfigError("Config error:" + "".join(f"\n  {line}" for line in lines) + f"\n  {todo[0].upper() + todo[1:]}.")


def _close_names(name: str, candidates: Sequence[str]) -> list[str]:
    """Environment variable names close to ``name``: other case, a close spelling, or sharing a word (3+ letters)
    such as ``OPENROUTER`` in ``OPENROUTER_KEY``; at most three."""
    upper = {c.upper(): c for c in candidates}
    found = [upper[k] for k in difflib.get_close_matches(name.upper(), list(upper), n=3, cutoff=0.75)]
    words = {w for w in name.upper().split("_") if len(w) >= 3 and w not in ("API", "KEY", "TOKEN", "SECRET")}
    for c in sorted(candidates):
        if c not in found and words & set(c.upper().split("_")) and any(w in c.upper() for w in ("KEY", "TOKEN")):
            found.append(c)
    return [c for c in found if c != name][:3]
