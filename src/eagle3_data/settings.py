"""One typed settings object per stage, built once from the validated config; defaults only from the schema.

Every stage's script builds its settings with ``<Stage>Settings.from_config(snakemake.config, ...)`` and passes
that one object to the stage's entry point; no stage function restates a config default in its signature
(``tests/unit/test_settings.py`` checks both). A field missing from the config (a config that was never validated, a
test's partial config) takes the schema's ``default``, read from the schema the package ships (:mod:`eagle3_data.config.schema`) (a key without
a default: ``None``); :meth:`defaults` builds a stage's settings from the schema alone, with overrides, for
library use and tests.

Rule ``params`` are each settings object's :meth:`params`: the content keys a stage's OUTPUT depends on
(:data:`eagle3_data.config.MERGE_DATA_KEYS` and the other ``*_DATA_KEYS``), the same values as before these
objects existed, so a change reruns exactly the rules whose output it changes. The other fields (memory,
threads, devices, reject ceilings) are read at run time and rerun nothing.

The objects are frozen dataclasses; their mapping-valued fields hold the config's plain values (lists, dicts),
so ``params()`` stays JSON-like and equal to the config's slices.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from . import config as cfg
from .config.schema import SCHEMA_PATH, default, filled, schema, schema_node  # noqa: F401

_default = default  # the schema's default of a dotted key (eagle3_data.config.schema.default)


def _build(cls, values: dict, **extra):
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in values.items() if k in names}, **extra)


class _Settings:
    """Common part of the stage settings: :meth:`params` (the content keys) and :meth:`as_dict`."""

    #: the fields a stage's output depends on: its rule's params
    CONTENT: ClassVar[tuple[str, ...]] = ()

    def params(self) -> dict:
        """The content keys and their values (the rule's params: a change reruns the stage)."""
        out = {}
        for k in self.CONTENT:
            v = getattr(self, k)
            out[k] = v.params() if isinstance(v, _Settings) else v
        return out

    def as_dict(self) -> dict:
        """Every field as a plain dict (nested settings as dicts too)."""
        return {
            f.name: (lambda v: v.as_dict() if isinstance(v, _Settings) else v)(getattr(self, f.name))
            for f in fields(self)
        }

    #: the config section a settings class is filled from as it is (``from_config`` / ``defaults`` below), if any
    SECTION: ClassVar[str | None] = None

    @classmethod
    def from_config(cls, config: dict):
        """The settings of ``config[SECTION]`` with the schema's defaults where unset."""
        return _build(cls, filled(cls.SECTION, config.get(cls.SECTION)))

    @classmethod
    def defaults(cls, **values):
        """The schema's defaults, updated by ``values``."""
        return _build(cls, filled(cls.SECTION, values))

    def replace(self, **changes):
        """A copy with ``changes`` (field name -> value)."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class TargetSettings(_Settings):
    """The ``target`` section: identity, tokenizer directory, template family, chat-template variables."""

    name: str
    path: str
    build_tiny: bool
    trust_remote_code: bool
    template: str
    chat_template_kwargs: dict

    CONTENT: ClassVar = cfg.TARGET_DATA_KEYS

    @classmethod
    def from_config(cls, config: dict) -> "TargetSettings":
        return _build(cls, filled("target", config["target"]))

    @classmethod
    def defaults(cls, **values) -> "TargetSettings":
        """Schema defaults; ``name``, ``path`` and ``template`` have none (``"target"``, ``"."``, ``"generic"``
        unless given)."""
        return _build(cls, filled("target", {"name": "target", "path": ".", "template": "generic", **values}))


@dataclass(frozen=True)
class TinyTargetSettings(_Settings):
    """``target.tiny``: the demo's random-weight target (rule tiny_target)."""

    seed: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_position_embeddings: int
    mean_reasoning_tokens: float
    mean_completion_tokens: float
    kind: str = "kimi"

    def params(self) -> dict:
        """:meth:`_Settings.params`, with ``kind`` only when it is not the default (a default build's params, and
        so its target, stay those of the builds made before the key existed)."""
        out = super().params()
        if self.kind != "kimi":
            out["kind"] = self.kind
        return out

    CONTENT: ClassVar = (
        "seed",
        "hidden_size",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "intermediate_size",
        "max_position_embeddings",
        "mean_reasoning_tokens",
        "mean_completion_tokens",
    )

    @classmethod
    def from_config(cls, config: dict) -> "TinyTargetSettings":
        return _build(cls, filled("target.tiny", config["target"].get("tiny")))

    @classmethod
    def defaults(cls, **values) -> "TinyTargetSettings":
        return _build(cls, filled("target.tiny", values))


@dataclass(frozen=True)
class GGUFTargetSettings(_Settings):
    """``target.gguf``: a real target converted from a GGUF file (rule gguf_target). ``file`` and ``package`` say
    where the file is (the rule's input, :func:`eagle3_data.gguf_target.gguf_file`); ``generation_config`` is the
    conversion setting (params)."""

    file: str | None
    package: str | None
    generation_config: dict

    CONTENT: ClassVar = ("generation_config",)

    @classmethod
    def from_config(cls, config: dict) -> "GGUFTargetSettings":
        return _build(cls, filled("target.gguf", config["target"].get("gguf")))

    @classmethod
    def defaults(cls, **values) -> "GGUFTargetSettings":
        return _build(cls, filled("target.gguf", values))


@dataclass(frozen=True)
class NormalizeSettings(_Settings):
    """One dataset's source (``datasets.<ds>.source``) and shard count; ``max_reject_rate`` is the ceiling in
    force: the dataset's own, else ``normalize.max_reject_rate``."""

    dataset: str
    format: str
    path: str
    max_samples: int | None
    options: dict | None
    shards: int
    max_reject_rate: float
    #: ``source.on_error``: ``fail`` (the default) or ``skip`` (an invalid JSONL line rejected and counted)
    on_error: str = "fail"
    #: ``source.duplicate_prompts`` (else ``normalize.duplicate_prompts``): ``drop`` (a later row with an earlier
    #: row's prompt is rejected ``duplicate_prompt``) or ``keep``
    duplicate_prompts: str = "drop"

    CONTENT: ClassVar = cfg.SOURCE_DATA_KEYS

    def params(self) -> dict:
        """The content keys; ``on_error`` only when set off its default, so existing params stay unchanged."""
        out = super().params()
        if self.on_error != "fail":
            out["on_error"] = self.on_error
        out["duplicate_prompts"] = self.duplicate_prompts
        return out

    @classmethod
    def from_config(cls, config: dict, ds: str) -> "NormalizeSettings":
        entry = config["datasets"][ds]
        src = {k: entry["source"].get(k) for k in cls.CONTENT}  # no schema defaults: None when left out
        own = entry["source"].get("max_reject_rate")
        section = filled("normalize", config.get("normalize"))
        ceiling = own if own is not None else section["max_reject_rate"]
        shards = entry.get("shards", _default("datasets.<name>.shards"))
        return _build(
            cls,
            src,
            dataset=ds,
            shards=int(shards),
            max_reject_rate=float(ceiling),
            on_error=entry["source"].get("on_error") or "fail",
            duplicate_prompts=entry["source"].get("duplicate_prompts") or section["duplicate_prompts"],
        )

    @classmethod
    def defaults(cls, dataset: str = "ds", **values) -> "NormalizeSettings":
        """``format`` and ``path`` have no default (``"sharegpt"``, ``""`` unless given)."""
        source = {
            k: values.pop(k)
            for k in ("format", "path", "max_samples", "options", "max_reject_rate", "on_error", "duplicate_prompts")
            if k in values
        }
        source = {"format": "sharegpt", "path": "", **source}
        return cls.from_config({"datasets": {dataset: {"source": source, **values}}}, dataset)


@dataclass(frozen=True)
class DecontaminateSettings(_Settings):
    """The ``decontaminate`` section (rules ``minhash`` and ``decontaminate``, :mod:`eagle3_data.decontaminate`).

    The stage is :attr:`on` when ``benchmarks`` lists a file or ``near_duplicates.enabled``; off, no rule of it is
    in the DAG and generate reads the normalized prompts as before. :meth:`params` (rule decontaminate) holds only
    the parts in force: the benchmark rule's keys when benchmarks are listed, the near-duplicate keys when enabled,
    so a key of a rule that is off reruns nothing; :meth:`signature_params` are rule minhash's."""

    benchmarks: list
    ngram: int
    min_shared_ngrams: int
    near_duplicates: dict

    SECTION: ClassVar = "decontaminate"

    @property
    def on(self) -> bool:
        return bool(self.benchmarks) or bool(self.near_duplicates.get("enabled"))

    @property
    def near_on(self) -> bool:
        return bool(self.near_duplicates.get("enabled"))

    def params(self) -> dict:
        """Rule decontaminate's params: the benchmarks (name, format, field, id_field: the files themselves are the
        rule's inputs), ``ngram`` and ``min_shared_ngrams`` when benchmarks are listed; ``near_duplicates``
        (threshold and the signature keys) when enabled."""
        out: dict = {}
        if self.benchmarks:
            out["benchmarks"] = [
                {k: b[k] for k in ("name", "format", "field", "id_field") if b.get(k) is not None}
                for b in self.benchmarks
            ]
            out["ngram"] = self.ngram
            out["min_shared_ngrams"] = self.min_shared_ngrams
        if self.near_on:
            out["near_duplicates"] = {"threshold": self.near_duplicates["threshold"], **self.signature_params()}
            if self.near_duplicates.get("within_dataset"):  # only when on: the params of existing builds stay
                out["near_duplicates"]["within_dataset"] = True
        return out

    @property
    def within_on(self) -> bool:
        """Near-duplicates are also looked for within each dataset (``near_duplicates.within_dataset``)."""
        return self.near_on and bool(self.near_duplicates.get("within_dataset"))

    def signature_params(self) -> dict:
        """Rule minhash's params: what a signature depends on (``num_perm``, ``shingle``, ``seed``)."""
        return {k: self.near_duplicates[k] for k in ("num_perm", "shingle", "seed")}


@dataclass(frozen=True)
class TokenizeSettings(_Settings):
    """Rule tokenize for one dataset: the target, the dataset's ``generation.extra_body.chat_template_kwargs``
    (they update the target's, as they did for the request) and its ``generation.max_tokens`` (a billed
    completion count at it means the reply was cut)."""

    target: TargetSettings
    chat_template_kwargs: dict | None
    max_tokens: int | None

    CONTENT: ClassVar = ("target", "chat_template_kwargs", "max_tokens")

    @classmethod
    def from_config(cls, config: dict, ds: str) -> "TokenizeSettings":
        gen = cfg.generation_config(config, ds)
        # an answers: original dataset sends no request: no max_tokens cut its answers (nothing billed either)
        max_tokens = None if cfg.is_original(config, ds) else gen.get("max_tokens")
        return cls(
            TargetSettings.from_config(config), (gen.get("extra_body") or {}).get("chat_template_kwargs"), max_tokens
        )

    @classmethod
    def defaults(cls, target: TargetSettings | dict | None = None, **values) -> "TokenizeSettings":
        t = target if isinstance(target, TargetSettings) else TargetSettings.defaults(**(target or {}))
        return cls(t, values.get("chat_template_kwargs"), values.get("max_tokens"))


@dataclass(frozen=True)
class ValidateSettings(_Settings):
    """The ``validate`` section and the target. ``keep_truncated``, ``max_tokens`` and the per-sample count
    tolerance decide the rejects (params); ``max_reject_rate`` and ``count_tolerance.aggregate_rel`` only whether
    the job fails (read at run time)."""

    target: TargetSettings
    max_reject_rate: float
    keep_truncated: bool
    count_tolerance: dict
    max_tokens: int | None

    CONTENT: ClassVar = cfg.VALIDATE_DATA_KEYS + ("count_tolerance",)

    def params(self) -> dict:
        """The keys that decide rejects (the aggregate tolerance only fails the job: not a rerun trigger)."""
        out = {k: getattr(self, k) for k in cfg.VALIDATE_DATA_KEYS}
        out["count_tolerance"] = {k: self.count_tolerance[k] for k in ("per_sample_abs", "per_sample_rel")}
        return out

    @classmethod
    def from_config(cls, config: dict) -> "ValidateSettings":
        return _build(cls, filled("validate", config.get("validate")), target=TargetSettings.from_config(config))

    @classmethod
    def defaults(cls, target: TargetSettings | dict | None = None, **values) -> "ValidateSettings":
        t = target if isinstance(target, TargetSettings) else TargetSettings.defaults(**(target or {}))
        return _build(cls, filled("validate", values), target=t)


@dataclass(frozen=True)
class MergeSettings(_Settings):
    """The ``merge`` section. ``memory_mb`` and ``threads`` are the job's resources (a profile may override
    them; the job then gets the profile's). ``heldout``: the held-out share in [0, 1) (0: off)."""

    datasets: list | None
    max_samples: dict
    max_len: int
    overflow: str
    seed: int
    shards: int
    memory_mb: int
    threads: int
    heldout: float

    CONTENT: ClassVar = cfg.MERGE_DATA_KEYS

    SECTION: ClassVar = "merge"

    def params(self) -> dict:
        """The content keys; ``heldout`` only when on (> 0), so a build that leaves it off keeps its params (nothing
        reruns)."""
        out = super().params()
        if self.heldout:
            out["heldout"] = self.heldout
        return out


@dataclass(frozen=True)
class ExtractSettings(_Settings):
    """The ``extract`` section with the target's directory and ``trust_remote_code`` and the run's
    ``cache_dir`` (where the extraction links that outlive results/ are kept). The stored layout
    (:data:`eagle3_data.config.EXTRACT_STATE_KEYS`) is the rule's params; devices, batch size, attention path and
    locks change how it runs, not what it writes."""

    backend: str
    layers: list | None
    dtype: str
    device: str
    gpus_per_job: int
    batch_tokens: int
    attention: str
    final_norm: str
    final_states: str
    aux_format: str
    final_format: str
    drafters: list
    dflash_layers: list | int | None
    fused: str
    gpu_lock_dir: str | None
    model_path: str
    trust_remote_code: bool
    cache_dir: str

    CONTENT: ClassVar = cfg.EXTRACT_STATE_KEYS

    def params(self) -> dict:
        """The stored layout (:data:`eagle3_data.config.EXTRACT_STATE_KEYS`); ``final_format``, ``drafters`` and
        ``dflash_layers`` only where they change what is stored (``final_format`` other than ``same``, a drafter
        other than ``eagle3``; ``dflash_layers`` with a DFlash-family drafter), so a config that leaves them at
        their defaults keeps the params, and the files, it had before they existed."""
        out = super().params()
        if out.get("final_format") == "same":
            del out["final_format"]
        if list(out.get("drafters") or ["eagle3"]) == ["eagle3"]:
            del out["drafters"]
        if not {"dflash", "dspark"} & set(self.drafters or []):
            del out["dflash_layers"]
        return out

    @classmethod
    def from_config(cls, config: dict) -> "ExtractSettings":
        t = TargetSettings.from_config(config)
        return _build(
            cls,
            filled("extract", config.get("extract")),
            model_path=t.path,
            trust_remote_code=t.trust_remote_code,
            cache_dir=config.get("cache_dir", _default("cache_dir")),
        )

    @classmethod
    def defaults(cls, model_path: str = ".", **values) -> "ExtractSettings":
        cache_dir = values.pop("cache_dir", _default("cache_dir"))
        trc = values.pop("trust_remote_code", _default("target.trust_remote_code"))
        return _build(cls, filled("extract", values), model_path=model_path, trust_remote_code=trc, cache_dir=cache_dir)

    def reuse_path(self, ds: str, shard: str) -> str:
        """The hard link under ``cache_dir`` that keeps a selection's computed rows across reruns."""
        return f"{self.cache_dir}/hidden_states/{ds}/{shard}.safetensors"


@dataclass(frozen=True)
class PlanSettings(_Settings):
    """The ``plan`` section, the extract settings it plans for and ``merge.overflow`` (what a cap does)."""

    tokens_per_s_per_gpu: float | None
    measure_tokens: int
    gpus_total: int
    caps: list
    drop: list
    write_gb_per_s: float | None
    extract: ExtractSettings
    overflow: str
    export_layouts: list
    cache_dir: str

    CONTENT: ClassVar = ("tokens_per_s_per_gpu", "measure_tokens", "gpus_total", "caps", "drop")

    def params(self) -> dict:
        """The plan keys (``write_gb_per_s`` only when set) and ``export.layouts`` (the exports whose bytes the
        disk check adds; only when some are requested): a change of either rewrites the plan, whose throughput
        measurement is then reused from ``cache_dir`` (:func:`eagle3_data.plan.measure_throughput`)."""
        out = super().params()
        if self.write_gb_per_s:
            out["write_gb_per_s"] = self.write_gb_per_s
        if self.export_layouts:
            out["export_layouts"] = list(self.export_layouts)
        return out

    def extract_params(self) -> dict:
        """The extract keys the plan depends on: the stored layout, ``gpus_per_job`` (wall hours) and, only when
        the plan measures the throughput itself, ``device``, ``batch_tokens`` and ``attention``."""
        out = {**self.extract.params(), "gpus_per_job": self.extract.gpus_per_job}
        if not self.tokens_per_s_per_gpu:
            out.update({k: getattr(self.extract, k) for k in ("device", "batch_tokens", "attention")})
        return out

    @classmethod
    def from_config(cls, config: dict) -> "PlanSettings":
        return _build(
            cls,
            filled("plan", config.get("plan")),
            extract=ExtractSettings.from_config(config),
            overflow=filled("merge", config.get("merge"))["overflow"],
            export_layouts=list(filled("export", config.get("export"))["layouts"]),
            cache_dir=config.get("cache_dir", _default("cache_dir")),
        )

    @classmethod
    def defaults(cls, extract: ExtractSettings | None = None, **values) -> "PlanSettings":
        overflow = values.pop("overflow", filled("merge", {})["overflow"])
        layouts = values.pop("export_layouts", filled("export", {})["layouts"])
        cache_dir = values.pop("cache_dir", _default("cache_dir"))
        return _build(
            cls,
            filled("plan", values),
            extract=extract or ExtractSettings.defaults(),
            overflow=overflow,
            export_layouts=list(layouts),
            cache_dir=cache_dir,
        )


@dataclass(frozen=True)
class VocabSettings(_Settings):
    """The ``vocab`` section and the target directory (its ``config.json`` gives the target vocabulary)."""

    draft_vocab_size: int
    model_path: str

    CONTENT: ClassVar = ("draft_vocab_size", "model_path")

    @classmethod
    def from_config(cls, config: dict) -> "VocabSettings":
        return _build(cls, filled("vocab", config.get("vocab")), model_path=config["target"]["path"])

    @classmethod
    def defaults(cls, model_path: str = ".", **values) -> "VocabSettings":
        return _build(cls, filled("vocab", values), model_path=model_path)


@dataclass(frozen=True)
class ExportSettings(_Settings):
    """The ``export`` section."""

    layouts: list
    group_size: int

    CONTENT: ClassVar = ("group_size",)

    SECTION: ClassVar = "export"


@dataclass(frozen=True)
class GenerationSettings(_Settings):
    """One dataset's ``generation`` settings: the global ``generation`` section under the dataset's own
    (:func:`eagle3_data.config.generation_config`), the schema's defaults where neither sets a key.

    :meth:`params` are the keys the responses depend on (:data:`eagle3_data.config.GENERATION_DATA_KEYS`, and
    ``reject_other_models`` / ``max_prompt_bytes`` only when set off their defaults, so existing params stay as
    they were); retries, backoff, the stop grace and ``unpaid_failures`` are read at run time and rerun nothing."""

    backends: list | None
    mode: str
    max_tokens: int | None
    temperature: float | None
    top_p: float | None
    extra_body: dict | None
    max_retries: int
    unpaid_failures: str
    retry_initial_s: float
    retry_max_s: float
    stop_grace_s: float
    reject_other_models: bool
    max_prompt_bytes: int | None
    max_samples: int | None
    budget_completion_tokens: int | None
    budget_usd: float | None

    CONTENT: ClassVar = cfg.GENERATION_DATA_KEYS

    SECTION: ClassVar = "generation"

    def params(self) -> dict:
        out = super().params()
        if self.reject_other_models:  # only when set: the default leaves existing params as they are
            out["reject_other_models"] = True
        bound = self.max_prompt_bytes
        if bound is not None and bound != _default("generation.max_prompt_bytes"):  # likewise: only when changed
            out["max_prompt_bytes"] = bound
        return out

    @classmethod
    def from_config(cls, config: dict, ds: str | None = None) -> "GenerationSettings":
        """Dataset ``ds``'s settings (the global section alone when ``ds`` is None)."""
        raw = cfg.generation_config(config, ds) if ds is not None else config.get("generation")
        return _build(cls, filled("generation", raw))

    @property
    def chat_template_kwargs(self) -> dict:
        """``extra_body.chat_template_kwargs`` (the dataset's chat-template variables; ``{}`` when unset)."""
        return (self.extra_body or {}).get("chat_template_kwargs") or {}

    def sampling(self) -> dict:
        """The sampling part of every request key (:data:`eagle3_data.generate.prompts.SAMPLING_KEYS`)."""
        from .generate.prompts import sampling_params

        return sampling_params(self)


def backend_settings(entry: dict | None) -> dict:
    """One ``backends.<name>`` entry with the schema's defaults where unset (plain values: the rule params read
    it; :meth:`eagle3_data.backends.definition.BackendConfig.from_dict` makes the typed form the job uses)."""
    return filled("backends.<name>", entry)


@dataclass(frozen=True)
class GenerateSettings(_Settings):
    """Rule generate (and forecast_pilot, which sends through it) for one dataset: the dataset's generation
    settings (:class:`GenerationSettings`), its backends' whole definitions (priority order, the schema's defaults
    where unset), the target, the journal directory under ``cache_dir`` and the shard count.

    :meth:`params` are the rule's params, what the responses depend on (:func:`generation_data_settings`,
    :func:`backends_data_settings`, the target name and, for SGLang's native ``/generate`` and vLLM's
    ``return_token_ids``, the target); the rest (concurrency, timeouts, rate limits, headers, key variables,
    launch, retries) is read at run time and reruns nothing."""

    dataset: str
    target_name: str
    generation: GenerationSettings
    #: backend name -> its config entry (plain values, schema defaults filled), in the dataset's priority order
    backends: dict
    #: backend name -> generate jobs using it in the whole workflow (:func:`eagle3_data.backends.limits.jobs_using`)
    backend_jobs: dict
    num_shards: int
    #: the target's params when a backend renders or checks prompt ids with its tokenizer, else None
    target: dict | None
    #: ``{"template": family, "chat_template_kwargs": {...}}`` of the target
    target_format: dict
    cache_dir: str
    #: where the responses are journaled (``<cache_dir>/journal``)
    journal_dir: str
    #: budget key -> where the config sets it (:func:`eagle3_data.config.generation_source`)
    budget_sources: dict

    CONTENT: ClassVar = ("target_name", "generation", "backends", "num_shards", "target", "target_format")

    def params(self) -> dict:
        """The rule's params: only the generation and backend keys the responses depend on."""
        return {
            "target_name": self.target_name,
            "generation": self.generation.params(),
            "backends": {
                name: {
                    **{k: b.get(k) for k in cfg.BACKEND_DATA_KEYS},
                    "launched": bool(b.get("launch")),
                    # only when set: a backend without it keeps its params (nothing reruns)
                    **({"return_token_ids": True} if b.get("return_token_ids") else {}),
                }
                for name, b in self.backends.items()
            },
            "num_shards": self.num_shards,
            "target": self.target,
            "target_format": self.target_format,
        }

    def backend_configs(self) -> list:
        """The typed backends (:class:`eagle3_data.backends.definition.BackendConfig`, fresh objects: the job
        sets a launched server's port in them), in the dataset's priority order. Raises ValueError when
        ``generation.backends`` is empty or names a backend not defined."""
        from .backends.definition import BackendConfig

        names = list(self.generation.backends or [])
        if not names:
            raise ValueError(f"dataset {self.dataset}: generation.backends is empty")
        unknown = [n for n in names if n not in self.backends]
        if unknown:
            raise ValueError(f"dataset {self.dataset}: generation.backends names unknown backends {unknown}")
        return [BackendConfig.from_dict(n, self.backends[n], self.generation.max_tokens) for n in names]

    def budget_source(self, key: str) -> str:
        """Where the config sets budget ``key`` (``"generation.<key>"`` when not known)."""
        return self.budget_sources.get(key) or f"generation.{key}"

    @classmethod
    def from_config(cls, config: dict, ds: str) -> "GenerateSettings":
        from .backends.limits import jobs_using

        t = TargetSettings.from_config(config)
        backends = {name: backend_settings(b) for name, b in cfg.backends_config(config, ds).items()}
        cache_dir = config.get("cache_dir", _default("cache_dir"))
        return cls(
            dataset=ds,
            target_name=t.name,
            generation=GenerationSettings.from_config(config, ds),
            backends=backends,
            backend_jobs={name: jobs_using(config, name) for name in backends},
            num_shards=cfg.dataset_shards(config, ds),
            target=_generation_target(t, backends),
            # the target's family: Kimi history tool-call ids, empty reasoning on tool-call turns of thinking targets
            target_format={"template": t.template, "chat_template_kwargs": t.chat_template_kwargs or {}},
            cache_dir=cache_dir,
            journal_dir=f"{cache_dir}/journal",
            # where the config sets each budget: named when a budget stops the shard
            budget_sources={
                k: cfg.generation_source(config, ds, k) for k in ("budget_usd", "budget_completion_tokens")
            },
        )

    @classmethod
    def defaults(
        cls,
        dataset: str = "ds",
        generation: dict | GenerationSettings | None = None,
        backends: dict | None = None,
        **values,
    ) -> "GenerateSettings":
        """Settings for library use and tests: ``generation`` (a dict: the schema's defaults where unset),
        ``backends`` (name -> entry: the schema's defaults where unset); ``values`` set the other fields as they
        are (``target_name`` ``"target"``, ``num_shards`` the schema's ``datasets.<name>.shards``, ``journal_dir``
        ``<cache_dir>/journal``, one generate job per backend, no target and no target format unless given)."""
        gen = (
            generation
            if isinstance(generation, GenerationSettings)
            else GenerationSettings.defaults(**(generation or {}))
        )
        bk = {name: backend_settings(b) for name, b in (backends or {}).items()}
        cache_dir = values.pop("cache_dir", _default("cache_dir"))
        out = {
            "dataset": dataset,
            "target_name": "target",
            "generation": gen,
            "backends": bk,
            "backend_jobs": {name: 1 for name in bk},
            "num_shards": _default("datasets.<name>.shards"),
            "target": None,
            "target_format": {},
            "cache_dir": cache_dir,
            "journal_dir": f"{cache_dir}/journal",
            "budget_sources": {},
        }
        return cls(**{**out, **{k: v for k, v in values.items() if v is not None or k == "target"}})


def _generation_target(t: TargetSettings, backends: dict) -> dict | None:
    """The target's params when a backend needs its tokenizer (SGLang's native /generate renders the prompt ids
    with it, vLLM's return_token_ids checks the server's prompt ids against it); otherwise None: the target config
    is not a dependency of generation."""
    native = any((b or {}).get("native_generate") or (b or {}).get("return_token_ids") for b in backends.values())
    return t.params() if native else None


@dataclass(frozen=True)
class OriginalAnswersSettings(_Settings):
    """Rule original_answers for one dataset (``answers: original``): the responses are the source's own assistant
    answers, no request is sent. What they depend on (:meth:`params`): ``generation.mode`` (which turns),
    ``generation.max_samples`` and the shard count (which samples: the same ones generate would take) and the
    target family's form of history tool-call ids (``tool_call_ids``: ``kimi`` rewrites them as the requests to a
    Kimi target are, ``source`` keeps them)."""

    dataset: str
    answers: str
    mode: str
    max_samples: int | None
    num_shards: int
    tool_call_ids: str

    CONTENT: ClassVar = ("answers", "mode", "max_samples", "num_shards", "tool_call_ids")

    @classmethod
    def from_config(cls, config: dict, ds: str) -> "OriginalAnswersSettings":
        from .templates.formats import FORMATS

        gen = GenerationSettings.from_config(config, ds)
        fmt = FORMATS.get(TargetSettings.from_config(config).template or "")
        return cls(
            dataset=ds,
            answers=cfg.answers_of(config["datasets"][ds]),
            mode=gen.mode,
            max_samples=gen.max_samples,
            num_shards=cfg.dataset_shards(config, ds),
            tool_call_ids="kimi" if fmt is not None and fmt.tool_format == "kimi" else "source",
        )

    @classmethod
    def defaults(cls, dataset: str = "ds", **values) -> "OriginalAnswersSettings":
        """The schema's defaults (``generation.mode``, ``generation.max_samples``, ``datasets.<name>.shards``; ids
        as in the source), updated by ``values``."""
        out = {
            "dataset": dataset,
            "answers": "original",
            "mode": _default("generation.mode"),
            "max_samples": _default("generation.max_samples"),
            "num_shards": _default("datasets.<name>.shards"),
            "tool_call_ids": "source",
        }
        return cls(**{**out, **values})


# The config slices the report rules pass as params, built from the stage settings above (the rules' params are
# each settings object's params(); these group them per dataset).


def datasets_data_settings(config: dict) -> dict:
    """Every dataset's source keys (``eagle3_data.config.SOURCE_DATA_KEYS``) and shard count: what the reports
    depend on; and ``answers: original`` where set (only then, so the other datasets' slices stay as they were)."""
    out = {}
    for ds in cfg.datasets(config):
        out[ds] = {
            "source": NormalizeSettings.from_config(config, ds).params(),
            "shards": cfg.dataset_shards(config, ds),
        }
        if cfg.is_original(config, ds):
            out[ds]["answers"] = "original"
    return out


def generation_data_settings(config: dict, ds: str) -> dict:
    """The generation settings of ``ds`` its responses depend on (``eagle3_data.config.GENERATION_DATA_KEYS``, and
    ``reject_other_models`` when it is set: left at its default it changes nothing, and reruns nothing)."""
    return GenerationSettings.from_config(config, ds).params()


def backends_data_settings(config: dict, ds: str) -> dict:
    """Per backend ``ds`` uses (priority order): the keys that say which endpoint answers and how requests
    are shaped (``eagle3_data.config.BACKEND_DATA_KEYS``); ``launch`` counts only as present or not."""
    return GenerateSettings.from_config(config, ds).params()["backends"]


#: every settings class and the schema section its own fields come from (tests/unit/test_settings.py)
SECTIONS: dict[type, str] = {
    TargetSettings: "target",
    TinyTargetSettings: "target.tiny",
    GGUFTargetSettings: "target.gguf",
    DecontaminateSettings: "decontaminate",
    ValidateSettings: "validate",
    MergeSettings: "merge",
    GenerationSettings: "generation",
    ExtractSettings: "extract",
    PlanSettings: "plan",
    VocabSettings: "vocab",
    ExportSettings: "export",
}


def stage_value(config: dict, path: str) -> Any:
    """The value of dotted config key ``path`` (``"merge.threads"``), the schema's default where unset."""
    head, _, key = path.rpartition(".")
    tree: Any = config
    for part in head.split(".") if head else []:
        tree = (tree or {}).get(part)
    return filled(head, tree)[key]
