"""The settings of the target and of every stage but generation (normalize ... export)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .. import config as cfg
from ..config.schema import filled
from ..config.schema import default
from .base import SettingsBase, build_settings


@dataclass(frozen=True)
class TargetSettings(SettingsBase):
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
        return build_settings(cls, filled("target", config["target"]))

    @classmethod
    def defaults(cls, **values) -> "TargetSettings":
        """Schema defaults; ``name``, ``path`` and ``template`` have none (``"target"``, ``"."``, ``"generic"``
        unless given)."""
        return build_settings(cls, filled("target", {"name": "target", "path": ".", "template": "generic", **values}))


@dataclass(frozen=True)
class TinyTargetSettings(SettingsBase):
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
        """:meth:`SettingsBase.params`, with ``kind`` only when it is not the default (a default build's params, and
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
        return build_settings(cls, filled("target.tiny", config["target"].get("tiny")))

    @classmethod
    def defaults(cls, **values) -> "TinyTargetSettings":
        return build_settings(cls, filled("target.tiny", values))


@dataclass(frozen=True)
class GGUFTargetSettings(SettingsBase):
    """``target.gguf``: a real target converted from a GGUF file (rule gguf_target). ``file`` and ``package`` say
    where the file is (the rule's input, :func:`eagle3_data.gguf_target.gguf_file`); ``generation_config`` is the
    conversion setting (params)."""

    file: str | None
    package: str | None
    generation_config: dict

    CONTENT: ClassVar = ("generation_config",)

    @classmethod
    def from_config(cls, config: dict) -> "GGUFTargetSettings":
        return build_settings(cls, filled("target.gguf", config["target"].get("gguf")))

    @classmethod
    def defaults(cls, **values) -> "GGUFTargetSettings":
        return build_settings(cls, filled("target.gguf", values))


@dataclass(frozen=True)
class NormalizeSettings(SettingsBase):
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
        shards = entry.get("shards", default("datasets.<name>.shards"))
        return build_settings(
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
class DecontaminateSettings(SettingsBase):
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
class TokenizeSettings(SettingsBase):
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
class ValidateSettings(SettingsBase):
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
        return build_settings(
            cls, filled("validate", config.get("validate")), target=TargetSettings.from_config(config)
        )

    @classmethod
    def defaults(cls, target: TargetSettings | dict | None = None, **values) -> "ValidateSettings":
        t = target if isinstance(target, TargetSettings) else TargetSettings.defaults(**(target or {}))
        return build_settings(cls, filled("validate", values), target=t)


@dataclass(frozen=True)
class MergeSettings(SettingsBase):
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
class ExtractSettings(SettingsBase):
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
        return build_settings(
            cls,
            filled("extract", config.get("extract")),
            model_path=t.path,
            trust_remote_code=t.trust_remote_code,
            cache_dir=config.get("cache_dir", default("cache_dir")),
        )

    @classmethod
    def defaults(cls, model_path: str = ".", **values) -> "ExtractSettings":
        cache_dir = values.pop("cache_dir", default("cache_dir"))
        trc = values.pop("trust_remote_code", default("target.trust_remote_code"))
        return build_settings(
            cls, filled("extract", values), model_path=model_path, trust_remote_code=trc, cache_dir=cache_dir
        )

    def reuse_path(self, ds: str, shard: str) -> str:
        """The hard link under ``cache_dir`` that keeps a selection's computed rows across reruns."""
        return f"{self.cache_dir}/hidden_states/{ds}/{shard}.safetensors"

    @staticmethod
    def validated_path(ds: str, shard: str) -> str:
        """The validated file a selection was made from (rule validate's output): its ``images`` column names the
        selection's rows with images. Not a rule input: the selection's digest, which holds the pictures' digests,
        decides a rerun (an input added to the rule would rerun every extract job of a build made before)."""
        return f"results/{ds}/validated/{shard}.parquet"


@dataclass(frozen=True)
class PlanSettings(SettingsBase):
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
        return build_settings(
            cls,
            filled("plan", config.get("plan")),
            extract=ExtractSettings.from_config(config),
            overflow=filled("merge", config.get("merge"))["overflow"],
            export_layouts=list(filled("export", config.get("export"))["layouts"]),
            cache_dir=config.get("cache_dir", default("cache_dir")),
        )

    @classmethod
    def defaults(cls, extract: ExtractSettings | None = None, **values) -> "PlanSettings":
        overflow = values.pop("overflow", filled("merge", {})["overflow"])
        layouts = values.pop("export_layouts", filled("export", {})["layouts"])
        cache_dir = values.pop("cache_dir", default("cache_dir"))
        return build_settings(
            cls,
            filled("plan", values),
            extract=extract or ExtractSettings.defaults(),
            overflow=overflow,
            export_layouts=list(layouts),
            cache_dir=cache_dir,
        )


@dataclass(frozen=True)
class VocabSettings(SettingsBase):
    """The ``vocab`` section and the target directory (its ``config.json`` gives the target vocabulary)."""

    draft_vocab_size: int
    model_path: str

    CONTENT: ClassVar = ("draft_vocab_size", "model_path")

    @classmethod
    def from_config(cls, config: dict) -> "VocabSettings":
        return build_settings(cls, filled("vocab", config.get("vocab")), model_path=config["target"]["path"])

    @classmethod
    def defaults(cls, model_path: str = ".", **values) -> "VocabSettings":
        return build_settings(cls, filled("vocab", values), model_path=model_path)


@dataclass(frozen=True)
class ExportSettings(SettingsBase):
    """The ``export`` section."""

    layouts: list
    group_size: int

    CONTENT: ClassVar = ("group_size",)

    SECTION: ClassVar = "export"
