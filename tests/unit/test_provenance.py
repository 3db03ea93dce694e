"""Rule provenance's table and JSON (src/eagle3_data/provenance.py) on small hand-made stage files: each merged row
joined to its responses row (``<id>@<turn>`` rows of generation mode all included) and its prompt's source row."""

from __future__ import annotations

import json
import subprocess

import pyarrow.parquet as pq

from eagle3_data.testing.workflow import ROOT
from eagle3_data import schemas
from eagle3_data.provenance import (
    PROVENANCE,
    MergedFiles,
    build_provenance,
    chat_template_sha256,
    config_digest,
    repository_commit,
)


def _merged(sid: str, ds: str) -> dict:
    return {
        "sample_id": sid,
        "dataset": ds,
        "input_ids": [1, 2, 3],
        "loss_mask": [0, 1, 1],
        "num_tokens": 3,
        "num_supervised": 2,
        "truncated": False,
        "source": f"{ds}/000",
    }


def _resp(sid: str, ds: str, turn: int, key: str, **kw) -> dict:
    return {
        "sample_id": sid,
        "dataset": ds,
        "turn": turn,
        "request_key": key,
        "messages": "[]",
        "status": "ok",
        "backend": "or",
        "provider": "prov-x",
        "model": "m/1",
        "generation_id": f"gen-{key}",
        "cost_usd": 0.5,
        "attempts": 2,
        "system_fingerprint": "fp_1",
        "completed_at": 1.0e9,
        **kw,
    }


def test_each_merged_row_gets_its_reply_and_source_row(tmp_path):
    def w(rows, kind, name):
        return (
            schemas.write_checked(schemas.from_rows(rows, schemas.ARROW_SCHEMAS[kind]), kind, tmp_path / name)
            or tmp_path / name
        )

    merged = [
        w([_merged("b", "gen"), _merged("a@3", "gen")], "merged", "m0.parquet"),
        w([_merged("a@1", "gen"), _merged("p1", "pre")], "merged", "m1.parquet"),
    ]
    held = w([_merged("c", "gen")], "merged", "held.parquet")
    # mode all: sample a has two turns in one shard (tokenize names them a@1, a@3); b and c one each; d failed
    responses = [
        w(
            [
                _resp("a", "gen", 1, "k1"),
                _resp("a", "gen", 3, "k3", cost_usd=0.25),
                _resp("b", "gen", 1, "kb", attempts=1),
                _resp("d", "gen", 1, "kd", status="failed"),
                _resp("c", "gen", 3, "kc"),
            ],
            "responses",
            "r.parquet",
        )
    ]
    prompts = [
        w(
            [
                {"sample_id": s, "dataset": "gen", "messages": "[]", "source_format": "sharegpt", "source_row": r}
                for s, r in (("a", 7), ("b", 2), ("c", 9))
            ],
            "prompts",
            "p.parquet",
        )
    ]
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text("{}")
    (target / "chat_template.jinja").write_text("{{ messages }}")
    doc = build_provenance(
        MergedFiles(merged, heldout=held, responses=responses, prompts=prompts),
        tmp_path / "prov.parquet",
        datasets={
            "gen": {
                "source_path": "g.json",
                "source_format": "sharegpt",
                "generation": {"temperature": 0.6, "top_p": 0.95, "max_tokens": 100, "extra_body": {}},
            },
            "pre": {"source_path": "p.jsonl", "source_format": "pretokenized", "generation": None},
        },
        backends={"or": {"type": "openrouter", "model": "m/1", "extra_body": {"top_k": 20}}},
        target_path=target,
        json_path=tmp_path / "prov.json",
        config={"x": 1},
        extra={"decontaminate": {}},
    )
    t = pq.read_table(tmp_path / "prov.parquet")
    assert t.schema.equals(PROVENANCE)
    got = {(r["set"], r["index"], r["sample_id"]): r for r in t.to_pylist()}
    assert list(got) == [
        ("train", 0, "b"),
        ("train", 1, "a@3"),
        ("train", 2, "a@1"),
        ("train", 3, "p1"),
        ("heldout", 0, "c"),
    ]
    a3 = got[("train", 1, "a@3")]
    assert (a3["request_key"], a3["cost_usd"], a3["source_row"], a3["merged_file"], a3["row"]) == (
        "k3",
        0.25,
        7,
        str(merged[0]),
        1,
    )
    assert (
        a3["backend"],
        a3["engine"],
        a3["engine_version"],
        a3["model"],
        a3["provider"],
        a3["generation_id"],
        a3["attempts"],
    ) == ("or", "openrouter", "fp_1", "m/1", "prov-x", "gen-k3", 2)
    assert json.loads(a3["sampling"]) == {
        "temperature": 0.6,
        "top_p": 0.95,
        "max_tokens": 100,
        "extra_body": {},
        "backend_extra_body": {"top_k": 20},
    }
    assert got[("train", 2, "a@1")]["request_key"] == "k1" and got[("train", 0, "b")]["attempts"] == 1
    assert got[("heldout", 0, "c")]["request_key"] == "kc" and got[("heldout", 0, "c")]["source_row"] == 9
    p1 = got[("train", 3, "p1")]  # pre-tokenized: its source only
    assert (p1["source_path"], p1["source_row"], p1["request_key"], p1["sampling"]) == ("p.jsonl", None, None, None)
    assert {r["chat_template_sha256"] for r in t.to_pylist()} == {chat_template_sha256(target)} != {None}
    assert doc["rows"] == {"train": 4, "heldout": 1, "without_reply": 0}
    assert doc["config_sha256"] == config_digest({"x": 1}) and len(doc["config_sha256"]) == 64
    assert doc["packages"]["datasketch"] and doc["packages"]["pyarrow"]
    assert json.loads((tmp_path / "prov.json").read_text()) == doc


def test_repository_commit_is_the_checkouts_head(tmp_path):
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if head.returncode != 0:
        assert repository_commit(ROOT) == {"commit": None, "dirty": None}
    else:
        got = repository_commit(ROOT)
        assert got["commit"] == head.stdout.strip() and got["dirty"] in (True, False)
    assert repository_commit(tmp_path) == {"commit": None, "dirty": None}  # no git checkout there
