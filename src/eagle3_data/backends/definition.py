"""A backend's settings: one entry of config ``backends:``.

Backends: ``type`` openai (any OpenAI-compatible server: vLLM, ``transformers serve``), openrouter, or sglang;
``base_url`` (``.../v1``), ``model``, ``api_key_env`` (the *name* of an environment variable, or null),
``max_concurrency``, ``timeout_s``, optional ``requests_per_minute`` and ``tokens_per_minute`` (aiolimiter buckets;
the token limit is charged *before* sending with the request's estimated prompt tokens (body bytes / 4, or the
prompt ids for native) + ``max_tokens``, as OpenAI-style TPM limits count ``max_tokens`` up front). Backend request
settings (not part of the request key): ``extra_body`` (merged into every body, e.g. SGLang
``chat_template_kwargs``/``separate_reasoning``), ``provider`` (OpenRouter routing: order, only, ignore,
allow_fallbacks, quantizations, require_parameters, data_collection ...) and ``reasoning`` (effort | max_tokens,
exclude, enabled) put into the body, ``headers`` (non-secret; ``Authorization`` refused). ``native_generate: true``
(type sglang) sends ``POST {root}/generate`` with the target-rendered ``input_ids`` and keeps the exact
``output_ids`` (:mod:`.native`). ``return_token_ids: true`` (type openai, a vLLM >= 0.10.2 server) asks the
chat-completions API for token ids: the reply's ``choices[0].token_ids`` are kept as the exact ``output_ids`` and its
top-level ``prompt_token_ids`` as ``prompt_ids`` (checked against the target's render of the prompt: the job's first
replies stop it on a mismatch, :mod:`..prompt_check`; later ones are rejects at tokenize). ``cost_lookup: true``
(type openrouter) looks the cost up by generation id when ``usage.cost`` is missing
(:meth:`.pool.Backend.lookup_cost`; first retry after ``cost_lookup_delay_s``). ``price_per_m`` (USD per million
prompt / completion tokens) costs a reply that comes without ``usage.cost``
(:func:`eagle3_data.generate.budget.reply_cost`).

Messages never contain the API key: it is only ever placed in the ``Authorization`` header.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .errors import FatalBackendError

#: the slowest decoding the default timeout allows for (tokens/s), and its allowance for queueing and the prompt (s)
TIMEOUT_TOKENS_PER_S = 10.0
TIMEOUT_BASE_S = 120.0
#: the default timeout when the requests leave max_tokens to the server (its limit is unknown here)
TIMEOUT_NO_MAX_TOKENS_S = 3600.0


def default_timeout_s(max_tokens: int | None) -> float:
    """Seconds a whole reply may take when ``backends.<name>.timeout_s`` is null: one that fits the longest reply
    ``max_tokens`` allows at :data:`TIMEOUT_TOKENS_PER_S` plus :data:`TIMEOUT_BASE_S` (2,048 tokens: 325 s;
    32,768: 3,397 s), else :data:`TIMEOUT_NO_MAX_TOKENS_S`. A reply past its timeout is abandoned and asked for
    again, and a provider may bill both, so the default errs long."""
    if not max_tokens:
        return TIMEOUT_NO_MAX_TOKENS_S
    return TIMEOUT_BASE_S + float(max_tokens) / TIMEOUT_TOKENS_PER_S


#: the API dialects (the schema's ``backends.<name>.type`` enum: tests/test_settings.py ties them)
BACKEND_TYPES = ("openai", "openrouter", "sglang")


@dataclass
class BackendConfig:
    """One entry of config ``backends:`` (``launch`` is handled by :mod:`.server`)."""

    name: str
    type: str
    base_url: str
    model: str
    api_key_env: str | None
    max_concurrency: int
    timeout_s: float
    requests_per_minute: float | None
    launch: dict | None
    headers: dict  # extra non-secret headers (e.g. X-Title)
    tokens_per_minute: float | None
    extra_body: dict  # merged into every request body (backend setting)
    provider: dict | None  # OpenRouter provider routing
    reasoning: dict | None  # OpenRouter / SGLang reasoning settings
    native_generate: bool  # SGLang: POST {root}/generate with input_ids (exact output_ids)
    return_token_ids: bool  # vLLM: ask for prompt_token_ids and choices[].token_ids in the chat reply
    cost_lookup: bool  # OpenRouter: GET /generation?id= when usage.cost is missing
    cost_lookup_delay_s: float  # first wait before a cost lookup retry (doubles, 5 tries)
    down_after_s: float  # refused connections / only 5xx for this long: the backend is out for the job
    price_per_m: dict | None = None  # USD per million prompt / completion tokens: a reply's cost without usage.cost

    @classmethod
    def from_dict(cls, name: str, cfg: dict, max_tokens: int | None = None) -> "BackendConfig":
        """The backend ``name`` of config ``backends:`` (``cfg``: its entry), the schema's defaults where unset
        (:func:`eagle3_data.config.schema.filled`); ``timeout_s`` null: :func:`default_timeout_s` of the
        requests' ``max_tokens``. Raises ValueError naming the backend and the bad key."""
        from ..config.schema import filled

        cfg = filled("backends.<name>", cfg)
        missing = [k for k in ("type", "base_url", "model") if not cfg.get(k)]
        if missing:
            raise ValueError(f"backend {name!r}: missing config keys {missing}")
        if cfg["type"] not in BACKEND_TYPES:
            raise ValueError(f"backend {name!r}: type {cfg['type']!r} is not one of {BACKEND_TYPES}")
        conc = int(cfg["max_concurrency"])
        if conc < 1:
            raise ValueError(f"backend {name!r}: max_concurrency must be >= 1, got {conc}")
        for k in ("extra_body", "headers", "provider", "reasoning"):
            if cfg.get(k) is not None and not isinstance(cfg[k], dict):
                raise ValueError(f"backend {name!r}: {k} must be a mapping, got {type(cfg[k]).__name__}")
        if cfg.get("provider") and cfg["type"] != "openrouter":
            raise ValueError(
                f"backend {name!r}: provider routing is an OpenRouter setting (type openrouter), "
                f"not for type {cfg['type']!r}"
            )
        if cfg.get("reasoning") and cfg["type"] not in ("openrouter", "sglang"):
            raise ValueError(f"backend {name!r}: reasoning settings need type openrouter or sglang")
        if cfg.get("native_generate") and cfg["type"] != "sglang":
            raise ValueError(f"backend {name!r}: native_generate needs type sglang, got {cfg['type']!r}")
        if cfg.get("return_token_ids") and cfg["type"] != "openai":
            raise ValueError(
                f"backend {name!r}: return_token_ids is a vLLM option (type openai), got type {cfg['type']!r}"
            )
        if cfg.get("cost_lookup") and cfg["type"] != "openrouter":
            raise ValueError(f"backend {name!r}: cost_lookup needs type openrouter, got {cfg['type']!r}")
        bad_headers = [h for h in (cfg.get("headers") or {}) if str(h).lower() in ("authorization", "x-api-key")]
        if bad_headers:
            raise ValueError(
                f"backend {name!r}: headers must not carry credentials ({bad_headers}); "
                "name the key's environment variable in api_key_env"
            )
        return cls(
            name=name,
            type=cfg["type"],
            base_url=str(cfg["base_url"]).rstrip("/"),
            model=str(cfg["model"]),
            api_key_env=cfg.get("api_key_env") or None,
            max_concurrency=conc,
            timeout_s=float(cfg["timeout_s"]) if cfg.get("timeout_s") is not None else default_timeout_s(max_tokens),
            requests_per_minute=cfg.get("requests_per_minute"),
            launch=cfg.get("launch"),
            headers={str(k): str(v) for k, v in (cfg.get("headers") or {}).items()},
            tokens_per_minute=cfg.get("tokens_per_minute"),
            extra_body=dict(cfg.get("extra_body") or {}),
            provider=dict(cfg["provider"]) if cfg.get("provider") else None,
            reasoning=dict(cfg["reasoning"]) if cfg.get("reasoning") else None,
            native_generate=bool(cfg["native_generate"]),
            return_token_ids=bool(cfg["return_token_ids"]),
            cost_lookup=bool(cfg["cost_lookup"]),
            cost_lookup_delay_s=float(cfg["cost_lookup_delay_s"]),
            down_after_s=float(cfg["down_after_s"]),
            price_per_m=dict(cfg["price_per_m"]) if cfg.get("price_per_m") else None,
        )

    @property
    def root_url(self) -> str:
        """``base_url`` without a trailing ``/v1`` (SGLang's native endpoints live at the server root)."""
        return self.base_url[:-3] if self.base_url.endswith("/v1") else self.base_url

    def api_key(self) -> str | None:
        """The key from the environment variable ``api_key_env``; error names the variable, not a value."""
        if not self.api_key_env:
            return None
        key = (os.environ.get(self.api_key_env) or "").strip()  # a key pasted with its newline still works
        if not key:
            raise FatalBackendError(
                f"backend {self.name!r}: environment variable {self.api_key_env} (api_key_env) is not set or empty",
                hint=f"export {self.api_key_env}=<your key> and rerun the same command",
            )
        if not all("!" <= ch <= "~" for ch in key):
            raise FatalBackendError(
                f"backend {self.name!r}: environment variable {self.api_key_env} (api_key_env) holds characters an "
                "HTTP header can't carry (whitespace inside the key, non-ASCII or control characters)",
                hint=f"set {self.api_key_env} to the key alone and rerun the same command",
            )
        from .paid import short_key_problem

        problem = short_key_problem(self.api_key_env, key)
        if problem:
            raise FatalBackendError(
                f"backend {self.name!r}: {problem}",
                hint=f"set {self.api_key_env} to the longer key and rerun the same command",
            )
        return key

    def scrub(self, text: str) -> str:
        """``text`` (from a server: error messages end up in logs and in failed rows) with this backend's API key
        replaced by ``[api key]`` (a server may echo the Authorization header) and unpaired surrogates by ``?``."""
        key = (os.environ.get(self.api_key_env) or "").strip() if self.api_key_env else ""
        if key:  # whatever its length: a local server's `--api-key abc` as well
            text = text.replace(key, "[api key]")
        return text.encode("utf-8", "replace").decode("utf-8")
