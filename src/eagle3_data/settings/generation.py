"""The settings of generation: the ``generation`` section of a dataset, the generate stage (its backends and
target) and the datasets whose answers are their own (rule original_answers)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .. import config as cfg
from ..config.schema import filled
from ..config.schema import default
from .base import SettingsBase, build_settings
from .stages import TargetSettings


@dataclass(frozen=True)
class GenerationSettings(SettingsBase):
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
        if bound is not None and bound != default("generation.max_prompt_bytes"):  # likewise: only when changed
            out["max_prompt_bytes"] = bound
        return out

    @classmethod
    def from_config(cls, config: dict, ds: str | None = None) -> "GenerationSettings":
        """Dataset ``ds``'s settings (the global section alone when ``ds`` is None)."""
        raw = cfg.generation_config(config, ds) if ds is not None else config.get("generation")
        return build_settings(cls, filled("generation", raw))

    @property
    def chat_template_kwargs(self) -> dict:
        """``extra_body.chat_template_kwargs`` (the dataset's chat-template variables; ``{}`` when unset)."""
        return (self.extra_body or {}).get("chat_template_kwargs") or {}

    def sampling(self) -> dict:
        """The sampling part of every request key (:data:`eagle3_data.generate.prompts.SAMPLING_KEYS`)."""
        from ..generate.prompts import sampling_params

        return sampling_params(self)


def backend_settings(entry: dict | None) -> dict:
    """One ``backends.<name>`` entry with the schema's defaults where unset (plain values: the rule params read
    it; :meth:`eagle3_data.backends.definition.BackendConfig.from_dict` makes the typed form the job uses)."""
    return filled("backends.<name>", entry)


@dataclass(frozen=True)
class GenerateSettings(SettingsBase):
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
        from ..backends.definition import BackendConfig

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
        from ..backends.limits import jobs_using

        t = TargetSettings.from_config(config)
        backends = {name: backend_settings(b) for name, b in cfg.backends_config(config, ds).items()}
        cache_dir = config.get("cache_dir", default("cache_dir"))
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
        cache_dir = values.pop("cache_dir", default("cache_dir"))
        out = {
            "dataset": dataset,
            "target_name": "target",
            "generation": gen,
            "backends": bk,
            "backend_jobs": {name: 1 for name in bk},
            "num_shards": default("datasets.<name>.shards"),
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
class OriginalAnswersSettings(SettingsBase):
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
        from ..templates.formats import FORMATS

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
            "mode": default("generation.mode"),
            "max_samples": default("generation.max_samples"),
            "num_shards": default("datasets.<name>.shards"),
            "tool_call_ids": "source",
        }
        return cls(**{**out, **values})
