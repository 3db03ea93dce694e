"""Image prompts at normalize (issue 46, first part): the LLaVA / ShareGPT4V / ALLaVA format and OpenAI image_url
parts, the bundled images and prompts (resources/samples/images/, resources/samples/llava.jsonl), the named rejects,
the prompt key, and the refusal of a build with image prompts before any job (the later stages do not take them
yet)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from eagle3_data.config import ConfigError
from eagle3_data.normalize import prompt_key
from eagle3_data.runtime.prerun import check_image_prompts
from eagle3_data.sources import get_adapter
from eagle3_data.tiny_vlm import draw_images
from test_normalize import SAMPLES, run, write_jsonl

IMAGES = SAMPLES / "images"


def digest(name: str) -> str:
    return hashlib.sha256((IMAGES / name).read_bytes()).hexdigest()


def test_the_bundled_images_are_the_drawn_ones(tmp_path):
    drawn = draw_images(tmp_path)
    assert sorted(p.name for p in IMAGES.iterdir()) == sorted(p.name for p in drawn)
    assert all((IMAGES / p.name).read_bytes() == p.read_bytes() for p in drawn)


def test_the_bundled_llava_prompts_normalize_with_their_images_in_place_and_named_rejects(tmp_path):
    counts, tables, rejects = run(
        tmp_path, SAMPLES / "llava.jsonl", "llava", shards=1, options={"image_dir": str(IMAGES)}
    )
    assert counts["rows_read"] == 8 and counts["kept"] == 6
    assert {(r["sample_id"], r["reason"]) for r in rejects} == {
        ("missing-0", "image_missing"),
        ("mismatch-0", "image_marker_mismatch"),
    }
    assert "purple_star.png" in next(r["detail"] for r in rejects if r["reason"] == "image_missing")
    rows = {r["sample_id"]: r for r in tables[0].to_pylist()}
    user = json.loads(rows["shape-0"]["messages"])[0]
    assert user == {
        "role": "user",
        "content": [
            {
                "type": "image_url",
                "image_url": {"url": str(IMAGES / "red_circle.png")},
                "image": {"sha256": digest("red_circle.png"), "width": 80, "height": 60},
            },
            {"type": "text", "text": "What shape is in this picture, and what color is it?"},  # the marker's \n went
        ],
    }
    # no marker, one image: before the text (LLaVA's convention); two markers: two images, in order
    assert [p["type"] for p in json.loads(rows["shape-1"]["messages"])[0]["content"]] == ["image_url", "text"]
    two = json.loads(rows["shape-2"]["messages"])[0]["content"]
    assert [Path(p.get("image_url", {}).get("url", "-")).name for p in two] == [
        "green_triangle.png",
        "yellow_bar.png",
        "-",
    ]
    # a marker mid-sentence stays mid-sentence; the assistant turns are kept for generate to replace
    mid = json.loads(rows["shape-4"]["messages"])
    assert [p.get("text") for p in mid[0]["content"]] == ["How many corners does the shape in ", None, " have?"]
    assert mid[1] == {"role": "assistant", "content": "Three: it is a triangle."}
    assert json.loads(rows["text-0"]["messages"])[0]["content"] == "Name three primary colors."  # a text prompt
    # the prompt key holds the images: one question about another picture is another prompt
    assert len({r["prompt_key"] for r in rows.values()}) == len(rows)


def test_without_an_image_folder_an_image_row_is_rejected_and_a_text_row_kept(tmp_path):
    counts, _, rejects = run(tmp_path, SAMPLES / "llava.jsonl", "llava", shards=1)
    assert counts["kept"] == 1 and {r["reason"] for r in rejects} == {"image_missing", "image_marker_mismatch"}
    assert any("set source.options.image_dir" in r["detail"] for r in rejects)


def test_an_unreadable_image_and_a_marker_in_a_reply_are_named_rejects(tmp_path):
    folder = tmp_path / "imgs"
    draw_images(folder)
    (folder / "broken.png").write_bytes((folder / "red_circle.png").read_bytes()[:50])
    src = write_jsonl(
        tmp_path / "s.jsonl",
        [
            {"id": "a", "image": "broken.png", "conversations": [{"from": "human", "value": "<image>\nWhat?"}]},
            {
                "id": "b",
                "image": "red_circle.png",
                "conversations": [
                    {"from": "human", "value": "<image> one"},
                    {"from": "gpt", "value": "two <image>"},
                ],
            },
            {"id": "c", "image": "../imgs/red_circle.png", "conversations": [{"from": "human", "value": "<image>"}]},
        ],
    )
    counts, _, rejects = run(tmp_path, src, "llava", shards=1, options={"image_dir": str(folder / "sub")})
    assert counts["kept"] == 0
    counts, tables, rejects = run(tmp_path, src, "llava", shards=1, options={"image_dir": str(folder)})
    assert [(r["sample_id"], r["reason"]) for r in rejects] == [
        ("a", "image_unreadable"),
        ("b", "image_marker_mismatch"),
    ]
    assert counts["kept"] == 1  # c: inside the folder after all (../imgs/ is the folder itself)


def test_openai_image_url_parts_are_read_with_an_image_folder_and_refused_without(tmp_path):
    record = {
        "id": "o",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Which color? "},
                    {"type": "image_url", "image_url": {"url": "blue_square.png"}},
                ],
            }
        ],
    }
    sample = get_adapter("openai_messages", {"image_dir": str(IMAGES)}).convert(record)
    assert sample.messages[0]["content"][1]["image"]["sha256"] == digest("blue_square.png")
    src = write_jsonl(tmp_path / "o.jsonl", [record])
    _, _, rejects = run(tmp_path, src, "openai_messages", shards=1)
    assert [r["reason"] for r in rejects] == ["malformed_message"]  # no image folder: image parts are not taken


def test_the_prompt_key_counts_the_images():
    text = [{"type": "text", "text": "What is this?"}]

    def ask(*names):
        pics = [{"type": "image_url", "image_url": {"url": n}, "image": {"sha256": digest(n)}} for n in names]
        return [{"role": "user", "content": [*pics, *text]}]

    assert prompt_key(ask("red_circle.png")) != prompt_key(ask("blue_square.png"))
    assert prompt_key(ask()) == prompt_key([{"role": "user", "content": "what is THIS"}])
    assert prompt_key(ask("red_circle.png")) == prompt_key(ask("red_circle.png"))
    assert prompt_key([{"role": "user", "content": [ask("red_circle.png")[0]["content"][0]]}]) is not None


@pytest.mark.parametrize("source", [{"format": "llava"}, {"format": "openai_messages", "options": {"image_dir": "x"}}])
def test_a_build_with_image_prompts_is_refused_where_a_stage_cannot_take_images(source):
    config = {"datasets": {"text": {"source": {"format": "sharegpt"}}, "pics": {"source": source}}}
    check_image_prompts(config)  # the transformers extraction backend, chat requests: runs
    with pytest.raises(ConfigError, match="datasets.pics holds image prompts, and extract.backend 'sglang'"):
        check_image_prompts({**config, "extract": {"backend": "sglang"}})
    native = {
        **config,
        "backends": {"srv": {"type": "sglang", "native_generate": True}},
        "generation": {"backends": ["srv"]},
    }
    with pytest.raises(ConfigError, match="its backend srv sends SGLang's native /generate"):
        check_image_prompts(native)
    # the same backend for a dataset whose answers are its own (no request): runs
    pics = {**native["datasets"]["pics"], "answers": "original"}
    check_image_prompts({**native, "datasets": {**native["datasets"], "pics": pics}})
    check_image_prompts({"datasets": {"text": {"source": {"format": "sharegpt"}}}, "extract": {"backend": "sglang"}})


def test_the_image_rejects_are_reject_reasons():
    from eagle3_data.images import IMAGE_REJECTS
    from eagle3_data.sources import REJECT_REASONS

    assert set(IMAGE_REJECTS) <= set(REJECT_REASONS)
    assert Path(SAMPLES / "llava.jsonl").is_file()
