"""The forecast's words and numbers (eagle3_data.forecast.markdown): dollars in cents, and the pilot's size as
planned and as sent."""

from __future__ import annotations

import pytest

from eagle3_data.forecast.markdown import forecast_usd, pilot_sentence


@pytest.mark.parametrize(
    ("usd", "shown", "cell"),
    [
        (6.9e-18, "under $0.01", "< 0.01"),  # float noise of a subtraction: no 0.0000000000000000069
        (0.0049, "under $0.01", "< 0.01"),
        (0.005, "$0.01", "0.01"),
        (0.0123, "$0.01", "0.01"),
        (0.126, "$0.13", "0.13"),
        (0.999, "$1.00", "1.00"),
        (86.04, "$86.04", "86.04"),
        (1234.5, "$1,234.50", "1,234.50"),
        (0.0, "$0.00", "0.00"),
        (-1e-12, "$0.00", "0.00"),
        (None, "unknown", "unknown"),
    ],
)
def test_forecast_dollars_are_cents_or_under_a_cent(usd, shown, cell):
    assert forecast_usd(usd) == shown
    assert forecast_usd(usd, sign=False) == cell


def _fc(planned: int, sent_and_samples: dict[str, tuple[int, int]]) -> dict:
    return {
        "pilot_samples": planned,
        "datasets": {
            ds: {"samples": total, "pilot": {"samples": sent}} for ds, (sent, total) in sent_and_samples.items()
        },
    }


def test_the_pilot_says_what_was_planned_and_what_each_dataset_sent():
    # every dataset sent the planned size: the size alone
    assert pilot_sentence(_fc(50, {"a": (50, 400), "b": (50, 60)})) == "From a pilot of 50 samples per dataset"
    assert pilot_sentence(_fc(8, {"ds": (8, 24)})) == "From a pilot of 8 samples"
    assert pilot_sentence(_fc(1, {"ds": (1, 24)})) == "From a pilot of 1 sample"
    # datasets smaller than the pilot sent all they have: the planned size, then what each sent and why
    assert (
        pilot_sentence(_fc(50, {"sharegpt_demo": (35, 35), "ultrachat_demo": (28, 28), "swe": (50, 900)}))
        == "From a pilot of 50 samples per dataset planned; sent: sharegpt_demo 35 (all it sends), "
        "ultrachat_demo 28 (all it sends), swe 50"
    )
    assert pilot_sentence(_fc(50, {"ds": (35, 35)})) == "From a pilot of 50 samples planned; sent: ds 35 (all it sends)"
    # fewer sent than planned though the dataset has more (a shard with fewer samples than its share): no reason
    assert (
        pilot_sentence(_fc(10, {"a": (9, 40), "b": (10, 40)}))
        == "From a pilot of 10 samples per dataset planned; sent: a 9, b 10"
    )
