"""Rules generate (prompts shard -> responses shard through the dataset's backends, journaled in cache/) and
forecast_pilot (rule generate with its own outputs: the shard's share of the forecast's pilot samples)."""

from eagle3_data.generate import startup

startup.acquire()  # one job per CPU core starts at a time, so the first requests leave early (eagle3_data.generate.startup)

import logging  # noqa: E402

from eagle3_data.runtime import run as run_mod  # noqa: E402
from eagle3_data.errors import in_workflow_run, run_stage  # noqa: E402
from eagle3_data.generate import generate  # noqa: E402
from eagle3_data.logs import setup_logging  # noqa: E402
from eagle3_data.settings import GenerateSettings  # noqa: E402

# inside a workflow run the console shows the run-wide view (eagle3_data.runtime.runview): this shard's progress lines,
# warnings and summary go to its log file, only its one-line error to the console; the view counts its warnings by
# reason. A job on another host than the run's (a cluster job: no view there) prints its warnings too.
console = logging.ERROR if run_mod.current() is not None else logging.WARNING if in_workflow_run() else None
log = setup_logging(snakemake.log[0], console_level=console)
ds, shard = snakemake.wildcards.ds, snakemake.wildcards.shard
# the whole settings from the config at run time (rule params carry only the part the responses depend on, as
# rerun triggers): concurrency, timeouts, rate limits, headers, key variables, launch and retries rerun nothing
settings = GenerateSettings.from_config(snakemake.config, ds)
out = snakemake.output

if snakemake.rule == "forecast_pilot":
    from eagle3_data.forecast import pilot

    run_stage(
        lambda: pilot(
            snakemake.input.prompts,
            out.responses,
            settings,
            n=snakemake.params.pilot_samples,
            shard=shard,
            log=log,
            summary_path=out.summary,
            attempts_path=f"{settings.cache_dir}/forecast/pilot/{ds}/{shard}.jsonl",
        ),
        log=log,
    )
else:
    run_stage(
        lambda: generate(
            snakemake.input.prompts, out.responses, settings, shard=shard, log=log, summary_path=out.summary
        ),
        log=log,
    )
