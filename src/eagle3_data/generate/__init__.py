"""The ``generate`` stage: send each prompt to the target model's backends, journal, write RESPONSES parquet.

One job = one dataset shard. Flow:

1. read the PROMPTS parquet (``schemas.PROMPTS``); a row whose ``messages``/``tools`` is not usable becomes a
   ``failed`` row with reason ``bad_prompt`` (no request is sent);
2. build the requests: mode ``last`` regenerates the final assistant turn (prompt = messages before it; a
   conversation without an assistant message is sent whole if it ends on a user/tool message); mode ``all``
   regenerates every assistant turn in order, each prompt built from the regenerated history (sequential per
   sample). Agent trajectories are the same: the prompt is cut before an assistant step;
3. request key = ``files.content_hash(dataset, sample_id, turn, target_name, prompt messages, tools, sampling)``
   with sampling = ``{max_tokens, temperature, top_p, extra_body}``: independent of the backend, so a response
   from OpenRouter satisfies the same request later routed to SGLang;
4. read the journal (:mod:`.journal`; only the fields resume needs are kept in memory); a key it lacks is looked
   up in every dataset's journal by what was asked (:mod:`.reuse`: prompt, tools, target, sampling), so a renamed
   dataset or one sharing prompts with another re-pays nothing; send only the keys still missing;
   local servers (a backend's ``launch:``) start only when something must be sent. A backend with
   ``native_generate`` gets prompt ids rendered with the target's chat template (``GenerateSettings.target``) and
   returns exact ``output_ids``; reasoning/content are split at the ``</think>`` id;
5. write every RESPONSES row with ``schemas.CheckedParquetWriter`` (arrow-level contract checks, atomic rename
   when the job succeeds): each new response is journaled, and its journal line goes into the output batch by
   batch while the job runs; responses of earlier runs are streamed back from the journal at the end, then the
   failed rows. Ok rows are never all held in memory. The job imports neither pandas nor ``pyarrow.compute`` /
   ``pyarrow.dataset`` (each ~50 MB of RSS; see :func:`schemas.table_from_json_lines`).

Budgets (per dataset in config; a shard job gets ``1/num_shards`` of each): ``max_samples`` caps the samples
considered (sorted by ``sample_id``), ``budget_completion_tokens`` and ``budget_usd`` stop *new* requests once
spent + (in flight x mean per completed request) reaches the budget, so the overshoot is at most what was in
flight. Samples never sent get no row (a rerun with a larger budget sends them); the summary counts them.

Failures: a sample whose retries ran out without a paid reply (:func:`eagle3_data.backends.errors.unpaid_reason`)
fails the job after the others are done (:class:`UnpaidFailures`: no output, so the rerun of the same command
reruns the job, which sends only those samples), unless ``generation.unpaid_failures`` is ``keep`` (a failed row);
a 4xx answer and a paid reject are final failed rows. A 429 slows the backend down
(:meth:`eagle3_data.backends.pool.Backend.rate_limited`) instead of using up the request's retries.

Modules: :mod:`.prompts` (samples, turns, request keys), :mod:`.budget` (the job's state and budgets),
:mod:`.reuse` (replies found by what was asked), :mod:`.runner` (the requests), :mod:`.output` (journal read-back into the RESPONSES parquet), :mod:`.context`
(log files, SIGTERM), :mod:`.job` (the entry, :func:`generate`); the journal is :mod:`eagle3_data.generate.journal`, the
progress display :mod:`eagle3_data.generate.progress`.
"""

from .budget import BudgetStop, JobState
from .backends import backend_pool
from .job import GenerationInterrupted, GenerationStopped, UnpaidFailures, generate
from .output import RESPONSE_FIELDS, journal_batches, wanted_runs, write_journaled, write_output
from .prompts import (
    PROMPT_ROLES,
    SAMPLING_KEYS,
    Sample,
    assistant_message,
    assistant_turns,
    read_prompts,
    request_key,
    sampling_params,
    shard_share,
)
from .runner import Runner, run_requests

__all__ = [
    "BudgetStop",
    "JobState",
    "GenerationInterrupted",
    "GenerationStopped",
    "UnpaidFailures",
    "backend_pool",
    "generate",
    "RESPONSE_FIELDS",
    "journal_batches",
    "wanted_runs",
    "write_journaled",
    "write_output",
    "PROMPT_ROLES",
    "SAMPLING_KEYS",
    "Sample",
    "assistant_message",
    "assistant_turns",
    "read_prompts",
    "request_key",
    "sampling_params",
    "shard_share",
    "Runner",
    "run_requests",
]
