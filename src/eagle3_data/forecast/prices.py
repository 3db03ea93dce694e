"""Per-token prices of a backend: OpenRouter's model list (fetched once, cached under ``cache_dir``) or the config's
``price_per_m``."""

from __future__ import annotations

import json
import time
from pathlib import Path

from ..files import content_hash, write_json
from .errors import ForecastError


#: per-token prices of OpenRouter's model list, by base_url + model: fetched once per job
_PRICE_CACHE: dict[str, dict] = {}


def _price_cache_path(cache_dir, base_url: str) -> Path:
    return Path(cache_dir) / "forecast" / f"prices-{content_hash(base_url, length=12)}.json"


def openrouter_prices(backend: dict, cache_dir, *, timeout_s: float = 30.0) -> dict | None:
    """USD per token ``{"prompt", "completion", "source"}`` of ``backend["model"]`` from OpenRouter's model list
    (``GET {base_url}/models``: ``data[].pricing.prompt`` / ``.completion``, decimal strings in USD per token).

    The list is fetched once and kept in ``<cache_dir>/forecast/prices-<hash of base_url>.json``. Returns None when
    the model is not listed or has no pricing; raises :class:`ForecastError` naming the URL when the list can't be
    fetched or read."""
    import httpx

    base = str(backend["base_url"]).rstrip("/")
    path = _price_cache_path(cache_dir, base)
    key = f"{base} {backend['model']}"
    if key in _PRICE_CACHE:
        return _PRICE_CACHE[key]
    if path.exists():
        listing = json.loads(path.read_text())
    else:
        url = f"{base}/models"
        try:
            resp = httpx.get(url, timeout=timeout_s)
            resp.raise_for_status()
            listing = {
                "url": url,
                "fetched_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "data": [
                    {"id": m.get("id"), "pricing": m.get("pricing")}
                    for m in resp.json().get("data", [])
                    if isinstance(m, dict)
                ],
            }
        except (httpx.HTTPError, ValueError, AttributeError) as exc:
            raise ForecastError(
                f"backend {backend.get('name', '?')}: can't read the model list {url} "
                f"({type(exc).__name__}: {str(exc)[:200]}); set backends.<name>.price_per_m "
                "instead"
            ) from None
        write_json(listing, path)
    out = None
    for m in listing.get("data", []):
        if m.get("id") == backend["model"] and isinstance(m.get("pricing"), dict):
            try:
                out = {
                    "prompt": float(m["pricing"]["prompt"]),
                    "completion": float(m["pricing"]["completion"]),
                    "source": f"OpenRouter model list ({listing.get('url')}, {listing.get('fetched_at')})",
                }
            except (KeyError, TypeError, ValueError):
                out = None
            break
    _PRICE_CACHE[key] = out
    return out


def backend_prices(name: str, backend: dict, cache_dir) -> dict | None:
    """USD per token ``{"prompt", "completion", "source"}`` of a backend: ``type: openrouter``: its model list
    (:func:`openrouter_prices`), else ``price_per_m`` from the config (USD per million tokens); None if neither."""
    if backend.get("type") == "openrouter":
        found = openrouter_prices({**backend, "name": name}, cache_dir)
        if found is not None:
            return found
    table = backend.get("price_per_m")
    if table:
        return {
            "prompt": float(table["prompt"]) / 1e6,
            "completion": float(table["completion"]) / 1e6,
            "source": f"config backends.{name}.price_per_m",
        }
    return None
