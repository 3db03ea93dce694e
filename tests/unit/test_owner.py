"""One build per dataset directory (eagle3_data.runtime.owner): the target a dataset is built for (and the config
file that defines it) is recorded beside its files; a config building a dataset of that name for another target is
refused in one line, and a copy of the config or an overlay on it carries the build on."""

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
SMOL, KIMI = "results/target/smollm2-135m-instruct", "models/Kimi-K2.5"


def test_the_defining_file_is_the_first_that_names_the_dataset():
    assert owner.defining_files(["sharegpt_demo", "ultrachat_demo"], [DEMO, DECON, SHRINK]) == {
        "sharegpt_demo": "config.yaml",
        "ultrachat_demo": "config.yaml",
    }
    assert owner.defining_files(["sharegpt"], [OPENROUTER]) == {"sharegpt": "resources/configs/openrouter.yaml"}


def test_a_dataset_built_for_another_target_is_refused_and_a_copy_of_the_config_is_not(tmp_path):
    results = tmp_path / "results"
    owner.record(["sharegpt", "ultrachat"], [REAL_SMALL], SMOL, results)
    assert json.loads((results / "sharegpt" / owner.MARKER).read_text()) == {
        "config": "resources/configs/real-small.yaml",
        "dataset": "sharegpt",
        "target": SMOL,
    }
    owner.check(["sharegpt", "ultrachat"], [REAL_SMALL], SMOL + "/", results)  # the same config and target again
    with pytest.raises(ConfigError) as e:
        owner.check(["sharegpt"], [OPENROUTER], KIMI, results)
    assert str(e.value) == (
        f"Config error: {results}/sharegpt/ holds dataset sharegpt built for target {SMOL} (by "
        "resources/configs/real-small.yaml); resources/configs/openrouter.yaml builds it for models/Kimi-K2.5: their "
        f"files would mix. Keep that build by moving it aside first (mv {results} {results}.real-small; mv logs "
        f"logs.real-small), or, to rebuild it here for models/Kimi-K2.5, delete {results}/sharegpt/{owner.MARKER}"
    )
    assert "\n" not in str(e.value)
    # a copy of the config with a dataset added (another file, the same target): the build carries on
    mine = ("my.yaml", {"target": {}, "datasets": {"sharegpt": {}, "ultrachat": {}, "extra": {}}})
    owner.check(["sharegpt", "ultrachat", "extra"], [mine], SMOL, results)
    # the demo, alone and with files layered on it; a marker deleted hands the dataset over; nothing built yet
    owner.record(["sharegpt_demo", "ultrachat_demo"], [DEMO], "results/target/tiny-kimi", results)
    owner.check(["sharegpt_demo", "ultrachat_demo"], [DEMO, DECON, SHRINK], "results/target/tiny-kimi", results)
    (results / "sharegpt" / owner.MARKER).unlink()
    owner.check(["sharegpt"], [OPENROUTER], KIMI, results)
    owner.check(["new"], [("x.yaml", {"datasets": {"new": {}}})], KIMI, results)
    # a marker that names no target (or is unreadable) refuses nothing
    (results / "ultrachat" / owner.MARKER).write_text(json.dumps({"config": "a.yaml", "dataset": "ultrachat"}))
    owner.check(["ultrachat"], [REAL_SMALL], KIMI, results)
