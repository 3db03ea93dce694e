"""Plan stage: storage, write rate and GPU hours of hidden-state extraction, before it runs, with alternatives
(:mod:`.build`: the figures and the stage's entry :func:`plan`; :mod:`.sizes`: bytes per token; :mod:`.report`: the
markdown report)."""

from .build import (  # noqa: F401
    build_plan,
    measure_key,
    measure_throughput,
    model_dims,
    plan,
    scenario_totals,
    sink_check,
    written_bytes,
)
from .report import render_markdown, summary_line  # noqa: F401
from .sizes import DTYPE_BYTES, TB, TIB, bytes_per_token, export_bytes_per_token  # noqa: F401
