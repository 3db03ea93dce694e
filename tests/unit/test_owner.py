"""One build per dataset directory (eagle3_data.runtime.owner): the config file that defines a dataset is recorded
beside its files, and another config naming the same dataset is refused in one line."""

from __future__ import annotations

import json

import pytest

from eagle3_data.config import ConfigError
from eagle3_data.runtime import owner

DEMO = ("config.yaml", {"target": {}, "datasets": {"sharegpt_demo": {}, "ultrachat_demo": {}}})
DECON = ("resources/configs/decontaminate.yaml", {"decontaminate": {"near_duplicates": {"enabled": True}}})
SHRINK = ("overrides.yaml", {"datasets": {"sharegpt_demo": {"shards": 1}}})
REAL_SMALL = ("resources/configs/real-small.yaml", {"target": {}, "datasets": {"sharegpt": {}, "ultrachat": {}}})
OPENROUTER = ("resources/configs/openrouter.yaml", {"target": {}, "datasets": {"sharegpt": {}}})


def test_the_defining_file_is_the_first_that_names_the_dataset():
    assert owner.defining_files(["sharegpt_demo", "ultrachat_demo"], [DEMO, DECON, SHRINK]) == {
        "sharegpt_demo": "config.yaml",
        "ultrachat_demo": "config.yaml",
    }
    assert owner.defining_files(["sharegpt"], [OPENROUTER]) == {"sharegpt": "resources/configs/openrouter.yaml"}


def test_a_dataset_built_by_another_config_is_refused_and_layers_are_not(tmp_path):
    results = tmp_path / "results"
    owner.record(["sharegpt", "ultrachat"], [REAL_SMALL], results)
    assert json.loads((results / "sharegpt" / owner.MARKER).read_text()) == {
        "config": "resources/configs/real-small.yaml",
        "dataset": "sharegpt",
    }
    owner.check(["sharegpt", "ultrachat"], [REAL_SMALL], results)  # the same config again
    with pytest.raises(ConfigError) as e:
        owner.check(["sharegpt"], [OPENROUTER], results)
    assert str(e.value) == (
        f"Config error: {results}/sharegpt/ holds dataset sharegpt as resources/configs/real-small.yaml defines it, "
        "not as resources/configs/openrouter.yaml does: their files would mix. Keep that build by moving it aside "
        f"first (mv {results} {results}.real-small; mv logs logs.real-small), or, if "
        f"resources/configs/openrouter.yaml is meant to carry on that build, delete {results}/sharegpt/{owner.MARKER}"
    )
    assert "\n" not in str(e.value)
    # the demo, alone and with files layered on it: its own datasets, no refusal; deleting the marker hands over
    owner.record(["sharegpt_demo", "ultrachat_demo"], [DEMO], results)
    owner.check(["sharegpt_demo", "ultrachat_demo"], [DEMO, DECON, SHRINK], results)
    (results / "sharegpt" / owner.MARKER).unlink()
    owner.check(["sharegpt"], [OPENROUTER], results)
    owner.check(["new"], [("x.yaml", {"datasets": {"new": {}}})], results)  # nothing built yet
