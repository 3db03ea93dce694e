# Stage 2: prompts shard -> responses shard, through the dataset's backends (OpenAI-compatible HTTP).
# Completed responses are journaled under cache/ (outside results/), keyed by a hash of the request, so a
# failed, killed or deleted target never pays for the same response twice.
# A backend's max_concurrency holds over all generate jobs on one machine, of every run (shared request slots), so
# every shard can be in flight at once; a launched server is started once per run and shared by every job that
# needs it (eagle3_data.runtime.run, eagle3_data.backends.server). Rule forecast_pilot (rules/forecast.smk) is this rule with
# its own outputs and pilot size.
import functools

from eagle3_data.settings import GenerateSettings


@functools.cache
def generate_settings(ds):
    """The settings of rule generate for dataset ``ds`` (built once per dataset)."""
    return GenerateSettings.from_config(config, ds)


def generate_param(key):
    """A params function: ``key`` of generate_settings(ds).params()."""
    return lambda wc: generate_settings(wc.ds).params()[key]


rule generate:
    input:
        prompts=GENERATION_PROMPTS,  # the prompts decontaminate kept when it is on, else normalize's
        target=target_input(),
    output:
        responses="results/{ds}/responses/{shard}.parquet",
        summary="results/{ds}/responses/{shard}.json",
    log:
        "logs/generate/{ds}/{shard}.log",
    wildcard_constraints:
        ds=_alternation(GENERATED),
    conda:
        "../envs/cpu.yaml"
    # an HTTP client waiting on its backends: it takes no core from --cores, so CPU stages keep running beside
    # it; how many run at once is the `generate_jobs` resource (profiles/default: 32; the run gives each a worker,
    # eagle3_data.runtime.run.widen_local_workers), shared out over the backends in use (seat_resources, rules/common.smk)
    threads: 0
    resources:
        **seat_resources(),
        # a cluster job starts its own server for a launched backend: it asks for the server's GPUs (sbatch --gpus).
        # Locally the run's one server holds its GPUs through the per-GPU locks (eagle3_data.devices) instead.
        generate_jobs=1,
        gpu=lambda wc: cfg.launch_gpus(config, wc.ds) if workflow.non_local_exec else 0,
    # params: what the responses depend on (GenerateSettings.params: cfg.GENERATION_DATA_KEYS, BACKEND_DATA_KEYS,
    # the target name and format, the target for SGLang's native /generate); the script reads the rest
    # (concurrency, timeouts, rate limits, headers, key variables, launch, retries) from the config at run time, so
    # changing those reruns nothing
    params:
        **{key: generate_param(key) for key in GenerateSettings.CONTENT},
    script:
        "../scripts/generate.py"
