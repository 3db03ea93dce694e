"""What the generate jobs hold on a machine: each backend's job seats and the GPUs of the servers the build
launches."""

from __future__ import annotations

import re

from .lookup import backends_config, dataset_shards, generated_datasets


def launch_gpus(config: dict, ds: str) -> int:
    """GPUs of the servers the build launches for dataset ``ds`` (``launch.gpus`` of its backends, summed)."""
    return sum(int((b.get("launch") or {}).get("gpus") or 0) for b in backends_config(config, ds).values())


def backend_job_seats(config: dict, generate_jobs: int) -> dict[str, int]:
    """Generate jobs each backend may have running at once on one machine: ``{backend: seats}``.

    ``generate_jobs`` (G) is the run's cap on generate jobs at once (the ``generate_jobs`` resource,
    profiles/default: 32). Without a cap per backend the scheduler may fill every seat with one backend's
    shards (e.g. 40 shards on a local server) while another backend's requests wait, idle. A job takes a seat
    of each backend its dataset uses. A backend's seats are ``backends.<name>.max_jobs`` or, unset, every seat
    the other backends' own jobs can't use: ``max(e, G - sum over the other backends o of min(n_o, e_o))``,
    with ``e`` the even share ``ceil(G / B)`` over the B backends the generated datasets use, ``e_o`` the even
    share or ``o``'s ``max_jobs`` where set, and ``n_o`` the jobs (shards) that use ``o`` but not this backend.
    So each other backend keeps at least ``min(n_o, e_o)`` seats for its own jobs, and when all the generate
    jobs fit in G every one of them can run at once (an even split would hold back the shards of a dataset that
    uses two backends while one backend's seats are full: in the seed config, 4 of 32 shards started only when
    others ended). Only backends some generated dataset uses are listed.
    """
    jobs = [(set(backends_config(config, ds)), dataset_shards(config, ds)) for ds in generated_datasets(config)]
    used = sorted({b for names, _n in jobs for b in names})
    g = int(generate_jobs)
    even = -(-g // len(used)) if used else g
    out = {}
    for b in used:
        own = (config["backends"][b] or {}).get("max_jobs")
        if own:
            out[b] = max(1, int(own))
            continue
        reserved = sum(
            min(
                int((config["backends"][o] or {}).get("max_jobs") or even),
                sum(n for names, n in jobs if o in names and b not in names),
            )
            for o in used
            if o != b
        )
        out[b] = max(1, even, g - reserved)
    return out


def seat_resource(backend: str) -> str:
    """The Snakemake resource name of a backend's generate-job seats: ``generate_jobs_<backend>`` (characters
    other than letters, digits and ``_`` become ``_``)."""
    return "generate_jobs_" + re.sub(r"\W", "_", backend)
