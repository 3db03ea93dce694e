"""Report plots laid out as drawn (eagle3_data.report.plots): measured on the figure, not looked at."""

from __future__ import annotations

import random

import pytest


def _overlap(a, b) -> bool:
    """Whether two matplotlib ``Bbox``es (display pixels) share an area."""
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


@pytest.mark.parametrize("datasets", [1, 3, 12])
def test_lengths_plot_title_sits_above_its_panels_titles(datasets):
    """lengths.png: the figure's title, each panel's title and the tick labels are laid out apart (constrained
    layout), measured on the drawn figure, for a few datasets and for many."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from eagle3_data.report.plots import lengths_figure

    rng = random.Random(datasets)
    rows = [
        {"dataset": f"dataset_{d:02d}", "prompt_tokens": rng.randint(1, 5000), "completion_tokens": rng.randint(1, 900)}
        for d in range(datasets)
        for _ in range(20)
    ]
    fig = lengths_figure(rows)
    renderer = FigureCanvasAgg(fig).get_renderer()
    fig.draw(renderer)
    (title,) = [t for t in fig.texts if t.get_text().startswith("Length distributions per dataset")]
    top = title.get_window_extent(renderer)
    panels = fig.axes
    assert [ax.get_title() for ax in panels] == ["Prompt tokens (loss mask 0)", "Completion tokens (loss mask 1)"]
    figure_box = fig.bbox
    for ax in panels:
        sub = ax.title.get_window_extent(renderer)
        assert not _overlap(top, sub), (top, sub)
        assert top.y0 >= sub.y1  # the figure's title above the panel's
        assert not _overlap(top, ax.get_window_extent(renderer))
        assert not _overlap(sub, ax.get_window_extent(renderer))  # the panel's title above its box plots
        for box in (top, sub):  # inside the figure: nothing cut at the edge
            assert figure_box.x0 <= box.x0 and box.x1 <= figure_box.x1 and box.y1 <= figure_box.y1
    left, right = (ax.get_tightbbox(renderer) for ax in panels)
    assert left.x1 <= right.x0  # the panels (labels included) side by side, apart
