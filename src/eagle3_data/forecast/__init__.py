"""The ``forecast`` target: what generation will cost and how long it will take, before paying for it.

Two rules (``rules/forecast.smk``):

1. ``forecast_pilot`` (one job per dataset shard, like ``generate``): sends a *pilot* of the shard's samples,
   ``forecast.pilot_samples`` per dataset split over its shards (:func:`.generate.shard_share`), through
   :func:`.generate.generate` itself: the same requests, request keys and journal
   (``<cache_dir>/journal/<dataset>/<shard>.jsonl``) as the full ``generate`` job, which then answers those samples
   from the journal (the pilot is never paid twice). The pilot samples are taken from the samples generate will
   send (the first ``max_samples`` share by ``sample_id``), in the order of a hash of their id, so that they are a
   sample of the dataset unrelated to its source order. Budgets don't apply to the pilot (it is small and its
   spend counts toward them in the full job, as every journaled response does).
2. ``forecast`` (one job): per generated dataset and in total

   - **requests**: the requests generate will send (one per sample; mode ``all``: one per assistant turn), after
     ``max_samples``; samples whose prompt is unusable send none;
   - **prompt tokens**: every request's prompt rendered with the target's chat template
     (``add_generation_prompt=True``) and encoded as ``tokenize`` does (:meth:`.templates.TargetTokens.render`,
     :meth:`~.templates.TargetTokens.encode_texts`); mode ``all`` renders the dataset's own earlier assistant turns,
     where the build puts the regenerated ones;
   - **expected completion tokens**: requests x the pilot's mean billed ``completion_tokens`` per answered request;
   - **dollars**: requests x the pilot's mean cost per answered request. A pilot response's cost is its
     ``usage.cost`` (OpenRouter returns it; ``cost_usd`` in the journal), else its billed prompt and completion
     tokens at the backend's per-token prices: for ``type: openrouter``, OpenRouter's model list
     (``GET {base_url}/models``, ``pricing.prompt`` / ``pricing.completion`` in USD per token; fetched once and
     cached in ``<cache_dir>/forecast/prices-<hash>.json``: delete it to fetch again), else the config's
     ``backends.<name>.price_per_m: {prompt, completion}`` (USD per million tokens). Without either, the dollars are
     unknown and the report says which key to set;
   - budgets: when the expected completion tokens or dollars pass ``budget_completion_tokens`` / ``budget_usd``,
     the requests sent, tokens and dollars are scaled down to the budget (generate stops new requests there);
   - **hours at the configured concurrency**: the mean of simulated runs of the whole generation
     (:func:`simulate_generation`), with their 10th and 90th percentiles: every shard's job at once, each
     backend's ``max_concurrency`` slots shared fairly by the jobs that use it, overflow to a dataset's next
     backend, reply lengths drawn from a lognormal fitted to the dataset's pilot lengths (capped at
     ``max_tokens``), latencies ``a + b x completion_tokens`` fitted per backend on the pilot (least squares,
     :func:`latency_fit`), rate limits and failures at the rates the pilot met (:func:`pilot_faults`), retried
     after generate's backoff. The tail (the long replies that start last, and the retries of long replies)
     is what spreads the runs. The latencies are the pilot's: a server loaded with ``max_concurrency``
     requests may answer slower, which the pilot (a few requests at once) can't see.

The forecast is written as ``results/reports/forecast.md`` (tables and the arithmetic) and ``forecast.json``.

The target lives in modules named for what they do; this package re-exports every name the single ``forecast``
module used to define, so ``from eagle3_data.forecast import X`` still works:

- :mod:`.pilot_job` - rule forecast_pilot's job: :func:`pilot`, :func:`pilot_sample_ids`, :func:`capped_samples`;
- :mod:`.prices` - :func:`backend_prices`, :func:`openrouter_prices` (the cached model list);
- :mod:`.fits` - :func:`latency_fit`, :func:`length_model`, :func:`expected_longest`;
- :mod:`.estimate` - :func:`forecast_dataset`: one dataset's requests, tokens and dollars;
- :mod:`.simulation` - :func:`simulate_generation`, :func:`simulated_hours`, :func:`backend_models`,
  :func:`pilot_faults`, :func:`job_overhead`;
- :mod:`.markdown` - :func:`render_markdown`, with :func:`~.markdown.forecast_usd` (dollars in cents) and
  :func:`~.markdown.pilot_sentence` (the pilot's size as planned and as sent);
- :mod:`.write` - rule forecast's job: :func:`forecast`;
- :mod:`.errors` - :class:`ForecastError`.
"""

from __future__ import annotations

from .errors import (  # noqa: F401
    ForecastError,
)
from .pilot_job import (  # noqa: F401
    capped_samples,
    logger,
    pilot,
    pilot_sample_ids,
)
from .prices import (  # noqa: F401
    backend_prices,
    openrouter_prices,
)
from .fits import (  # noqa: F401
    expected_longest,
    latency_fit,
    length_model,
)
from .estimate import (  # noqa: F401
    forecast_dataset,
)
from .simulation import (  # noqa: F401
    SIMULATIONS,
    SIM_MIN_RUNS,
    SIM_REQUESTS,
    backend_models,
    job_overhead,
    pilot_faults,
    simulate_generation,
    simulated_hours,
)
from .markdown import (  # noqa: F401
    render_markdown,
)
from .write import (  # noqa: F401
    forecast,
)
