"""A plain install (``pip install .``, not editable) works without the repository: the config schema and the test
support package's chat templates ship as package data."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from eagle3_data.testing.workflow import ROOT


@pytest.mark.slow
def test_a_plain_install_validates_a_config_from_another_directory(tmp_path):
    """``pip install .`` (not editable) into a folder of its own; from a directory outside the repository, the
    installed package (not the checkout) finds its schema, fills defaults and refuses a bad key."""
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
        timeout=600,
    )
    assert (target / "eagle3_data" / "config" / "config.schema.yaml").is_file()
    # the test support package's data ships too: the public chat templates its tokenizer fixtures read
    templates = target / "eagle3_data" / "testing" / "chat_templates"
    assert {p.name for p in templates.iterdir()} == {
        p.name for p in (ROOT / "src/eagle3_data/testing/chat_templates").iterdir()
    }
    code = (
        "import eagle3_data, yaml\n"
        "from eagle3_data.config import ConfigError, schema, validate_config\n"
        "from eagle3_data.settings import MergeSettings\n"
        "print(eagle3_data.__file__)\n"
        "ds = {'d': {'source': {'format': 'sharegpt', 'path': 'd.json'}}}\n"
        "cfg = validate_config({'target': {'name': 't', 'path': 'm'}, 'datasets': ds}, schema())\n"
        "print(cfg['merge']['seed'], MergeSettings.from_config(cfg).shards)\n"
        "try:\n"
        "    validate_config({'target': {'name': 't', 'path': 'm'}, 'datasets': ds, 'merg': {}}, schema())\n"
        "except ConfigError as e:\n"
        "    print('refused:', str(e).splitlines()[0])\n"
        "from eagle3_data.testing import tokenizer_fixtures\n"
        "print(tokenizer_fixtures.TEMPLATES_DIR, len(tokenizer_fixtures.chat_template('qwen3')) > 0)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    run = tmp_path / "elsewhere"
    run.mkdir()
    out = subprocess.run([sys.executable, "-c", code], cwd=run, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[0] == str(target / "eagle3_data" / "__init__.py")
    assert lines[1].split() == ["0", "1"]
    assert lines[2].startswith("refused:") and "merg" in lines[2]
    assert lines[3] == f"{target / 'eagle3_data' / 'testing' / 'chat_templates'} True"
