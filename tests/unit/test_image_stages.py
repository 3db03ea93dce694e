"""Image rows past tokenize (issue 46): validate's ``image_span`` check, the merge's image keys (the same ids with
other pictures are no duplicate, and a changed picture changes its selection's digest), the extract side's checks
of an image row (a cut span, a changed file, a backend without a vision tower), the reuse rule, the forecast's image
positions and the tiny VLM target kind."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest

from eagle3_data import images as im
from eagle3_data.merge import merge
from eagle3_data.settings import MergeSettings, TinyTargetSettings
from eagle3_data import tiny_vlm
from test_merge import row, write_inputs

PAD = tiny_vlm.IMAGE_TOKEN_ID


def _images(spans, digest="a" * 64, url="pic.png") -> str:
    return json.dumps(
        [{"url": url, "sha256": digest, "width": 8, "height": 8, "start": s, "length": n} for s, n in spans]
    )


def test_span_problem_names_each_broken_span():
    ids = [1, 2, PAD, PAD, PAD, 3, 4, 5]
    mask = [0, 0, 0, 0, 0, 0, 1, 1]
    assert im.span_problem(ids, mask, _images([(2, 3)])) is None
    assert "reach the first supervised position 4" in im.span_problem(ids, [0, 0, 0, 0, 1, 1, 1, 1], _images([(2, 3)]))
    assert "hold other ids" in im.span_problem(ids, mask, _images([(1, 3)]))
    assert "outside the row" in im.span_problem(ids, mask, _images([(6, 5)]))
    assert "overlapping image 0" in im.span_problem(ids, mask, _images([(2, 2), (3, 1)]))
    assert "outside the row" in im.span_problem(ids, mask, _images([(2, 0)]))


def test_validate_rejects_a_row_whose_image_span_does_not_fit(target):
    from eagle3_data.templates import load_target_tokens
    from eagle3_data.validate import Context, validate_rows

    tt = load_target_tokens(str(target), "auto")
    prompt = [151644, 872, 198, 151652, PAD, PAD, 151653, 3838, 151645, 198, 151644, 77091, 198]
    reply = [32, 2518, 12671, 13, 151645]
    good = {
        "sample_id": "s",
        "dataset": "d",
        "input_ids": prompt + reply,
        "loss_mask": [0] * len(prompt) + [1] * len(reply),
        "ids_source": "reconstructed",
        "finish_reason": "stop",
        "images": _images([(4, 2)]),
    }
    cut = {**good, "images": _images([(4, 3)])}  # one position more than the row holds
    late = {**good, "images": _images([(len(prompt), 2)])}
    got = validate_rows([good, cut, late, {**good, "images": None}], Context(tt))
    assert got[0] is None and got[3] is None
    assert got[1][0] == "image_span" and "hold other ids" in got[1][1]
    assert got[2][0] == "image_span" and "outside the row" not in got[2][1]


def _merge(tmp_path, rows, tag):
    files = write_inputs(tmp_path, rows, 1, tag=tag)
    out = tmp_path / tag / "merged.parquet"
    sel = tmp_path / tag / "selection.parquet"
    man = merge(
        files,
        [out],
        tmp_path / tag / "m.json",
        settings=MergeSettings.defaults(max_len=64, seed=0),
        selections=[sel],
        sources=["d/000"],
    )
    return man, pq.read_table(out).to_pylist()


def test_the_same_ids_with_other_pictures_are_no_duplicates_and_change_the_selection_digest(tmp_path):
    ids, mask = [1, PAD, PAD, 2, 3, 4], [0, 0, 0, 0, 1, 1]
    a = {**row("d", "a", ids, mask), "images": _images([(1, 2)], "a" * 64)}
    b = {**row("d", "b", ids, mask), "images": _images([(1, 2)], "b" * 64)}
    man, got = _merge(tmp_path, [a, b], "pics")
    assert sorted(r["sample_id"] for r in got) == ["a", "b"]  # other pictures: both kept
    man_text, got_text = _merge(tmp_path, [{**a, "images": None}, {**b, "images": None}], "text")
    assert [r["sample_id"] for r in got_text] == ["a"] and man_text["datasets"]["d"]["dropped"] == {"duplicate": 1}
    man_new, _ = _merge(tmp_path, [a, {**b, "images": _images([(1, 2)], "c" * 64)}], "changed")
    digest = lambda m: m["selections"]["d/000"]["digest"]  # noqa: E731
    assert digest(man_new) != digest(man)  # the same ids, another picture: extraction reruns
    man_again, _ = _merge(tmp_path, [a, b], "again")
    assert digest(man_again) == digest(man)


def test_an_image_rows_inputs_check_its_span_and_file(target, pictures, tmp_path):
    from eagle3_data.extract.vision import ImageInputs

    shutil.copy(pictures[0], tmp_path / "pic.png")  # red_circle.png, 80x60: 6 positions
    part = im.image_part("pic.png", tmp_path)
    ids = np.array([1, 151652] + [PAD] * 6 + [151653, 5], dtype=np.int32)
    entry = {"url": part["image_url"]["url"], **part["image"], "start": 2, "length": 6}
    inputs = ImageInputs(target)
    got = inputs(ids, json.dumps([entry]), "sel: sample 's'")
    assert got["image_grid_thw"].tolist() == [[1, 4, 6]] and got["pixel_values"].shape[0] == 24
    cut = np.concatenate([ids[:6], ids[8:]])  # two placeholder positions fewer: a cut image
    with pytest.raises(ValueError, match="takes 6 positions.*holds 4 placeholder"):
        inputs(cut, json.dumps([{**entry, "length": 4}]), "sel: sample 's'")
    shutil.copy(pictures[1], tmp_path / "pic.png")
    with pytest.raises(ValueError, match="sample 's'.*image_missing"):
        inputs(ids, json.dumps([entry]), "sel: sample 's'")


def test_image_rows_need_the_transformers_backend(tmp_path):
    from eagle3_data.extract.forward import Forward
    from eagle3_data.extract.layout import TokenShard
    from eagle3_data.settings import ExtractSettings
    from test_merge import row as vrow

    from eagle3_data import schemas

    path = tmp_path / "sel.parquet"
    schemas.write_checked(
        schemas.from_rows([vrow("d", "s", [1, 2, 3], [0, 1, 1])], schemas.VALIDATED), "validated", path
    )
    s = ExtractSettings.defaults(model_path=str(tmp_path)).replace(backend="sglang", final_norm="post")
    with pytest.raises(ValueError, match="only extract.backend transformers passes images"):
        Forward(
            TokenShard(path), {}, s, layers=[0], hidden_size=8, model=None, capture=None, stack=None, images={0: "[]"}
        )


def test_the_forecast_counts_each_image_as_the_processors_positions(target, pictures):
    from PIL import Image

    from eagle3_data.forecast.estimate import _prompt_lengths
    from eagle3_data.templates import load_target_tokens

    ti = im.TargetImages.load(target)
    for p in pictures:
        with Image.open(p) as pic:
            counts = ti.placeholder_counts(ti.inputs([pic.convert("RGB")])["image_grid_thw"])
            assert ti.count_for_size(*pic.size) == counts[0]
    tt = load_target_tokens(str(target), "auto")
    parts = [im.image_part(p.name, p.parent) for p in pictures[:2]]
    messages = [{"role": "user", "content": [*parts, {"type": "text", "text": "Which is bigger?"}]}]
    text = [{"role": "user", "content": "Which is bigger?"}]
    (with_pics,), _ = _prompt_lengths(tt, [(messages, None)], ti)
    (one_each,), _ = _prompt_lengths(tt, [(messages, None)])
    (none,), _ = _prompt_lengths(tt, [(text, None)], ti)
    sizes = [ti.count_for_size(p["image"]["width"], p["image"]["height"]) for p in parts]
    assert with_pics - one_each == sum(sizes) - 2 and one_each > none


def test_the_tiny_vlm_kind_is_a_param_only_when_chosen():
    default = TinyTargetSettings.defaults()
    assert default.kind == "kimi" and "kind" not in default.params()  # the demo's target keeps its params
    vlm = TinyTargetSettings.defaults(kind="qwen2.5-vl", seed=3)
    assert vlm.params()["kind"] == "qwen2.5-vl" and vlm.params()["seed"] == 3


def test_the_target_class_is_the_vlm_class_only_for_a_vlm_transformers_knows(tmp_path):
    import transformers

    from eagle3_data.extract.vision import model_class

    def target(name, cfg):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(cfg))
        return d

    vlm = {"model_type": "qwen2_5_vl", "vision_config": {"depth": 2}}
    assert model_class(target("vlm", vlm)) is transformers.AutoModelForImageTextToText
    assert model_class(target("text", {"model_type": "llama"})) is transformers.AutoModelForCausalLM
    # a target with its own code (Kimi K2.5's auto_map): loaded as its code says, as before
    own = {**vlm, "model_type": "kimi_k25", "auto_map": {"AutoModelForCausalLM": "modeling_kimi_k25.KimiK25"}}
    assert model_class(target("own", own)) is transformers.AutoModelForCausalLM
