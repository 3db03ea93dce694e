"""Image prompts (issue 46, first part): image parts, their files and rejects, and the exact ids of an image prompt
on a real processor (the tiny Qwen2.5-VL of ``eagle3_data.tiny_vlm``: Qwen's real vocabulary, the published
template, transformers' Qwen2-VL image processor), checked against transformers' own processor and run through the
model's vision tower."""

from __future__ import annotations

import base64
import json
import hashlib

import pytest

from eagle3_data import images as im
from eagle3_data import tiny_vlm


def test_the_bundled_images_are_drawn_the_same_every_time(pictures, tmp_path):
    again = tiny_vlm.draw_images(tmp_path)
    assert [p.read_bytes() for p in again] == [p.read_bytes() for p in pictures]
    assert len({hashlib.sha256(p.read_bytes()).hexdigest() for p in pictures}) == len(pictures)


def test_an_image_part_carries_the_files_digest_and_size_and_bad_files_are_named_rejects(pictures, tmp_path):
    folder = pictures[0].parent
    part = im.image_part("red_circle.png", folder)
    assert part["image_url"] == {"url": str(folder / "red_circle.png")}
    assert part["image"] == {
        "sha256": hashlib.sha256((folder / "red_circle.png").read_bytes()).hexdigest(),
        "width": 80,
        "height": 60,
    }
    with pytest.raises(im.ImageProblem) as e:
        im.image_part("nope.png", folder)
    assert e.value.reason == "image_missing" and "nope.png" in str(e.value)
    with pytest.raises(im.ImageProblem) as e:  # a path leaving the image folder is not in it
        im.image_part("../" + folder.name + "/red_circle.png", folder / "sub")
    assert e.value.reason == "image_missing"
    (tmp_path / "cut.png").write_bytes((folder / "red_circle.png").read_bytes()[:60])  # truncated
    (tmp_path / "text.png").write_text("not an image")
    for name in ("cut.png", "text.png"):
        with pytest.raises(im.ImageProblem) as e:
            im.image_part(name, tmp_path)
        assert e.value.reason == "image_unreadable" and name in str(e.value)
    assert set(im.IMAGE_REJECTS) == {"image_missing", "image_unreadable", "image_marker_mismatch"}


def test_a_request_carries_the_image_as_a_data_url_of_its_bytes(pictures, tmp_path):
    folder = pictures[0].parent
    content = [im.image_part("blue_square.png", folder), {"type": "text", "text": "What color?"}]
    sent = im.request_content(content)
    assert sent[1] == content[1] and set(sent[0]) == {"type", "image_url"}
    head, b64 = sent[0]["image_url"]["url"].split(",", 1)
    assert head == "data:image/png;base64" and base64.b64decode(b64) == (folder / "blue_square.png").read_bytes()
    assert im.request_content("plain text") == "plain text"
    assert im.content_text(content) == "What color?" and im.content_text(None) == ""
    messages = [{"role": "user", "content": content}]
    assert im.image_key(messages) == f'["{content[0]["image"]["sha256"]}"]' and im.image_key([]) == ""
    moved = {**content[0], "image_url": {"url": str(tmp_path / "blue_square.png")}}
    (tmp_path / "blue_square.png").write_bytes((folder / "red_circle.png").read_bytes())  # other bytes
    with pytest.raises(im.ImageProblem, match="changed since normalize"):
        im.request_content([moved])


def _prompt(folder, *names, text="What shape is this?"):
    return [
        {"role": "system", "content": "You describe pictures."},
        {"role": "user", "content": [*(im.image_part(n, folder) for n in names), {"type": "text", "text": text}]},
    ]


@pytest.mark.parametrize("names", [("red_circle.png",), ("green_triangle.png", "yellow_bar.png")])
def test_an_image_prompts_ids_are_the_processors_exactly(target, pictures, names):
    """Rendered by the target's template (one image token per image), then each image token repeated for its
    patch grid: the very ids transformers' Qwen2.5-VL processor gives for the same text and images."""
    from PIL import Image

    folder = pictures[0].parent
    processor = tiny_vlm.load_processor(target)
    messages = _prompt(folder, *names)
    text = processor.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.count("<|vision_start|><|image_pad|><|vision_end|>") == len(names)
    ids = processor.tokenizer(text, add_special_tokens=False)["input_ids"]
    pics = [Image.open(folder / n).convert("RGB") for n in names]
    t = im.TargetImages.load(target)
    inputs = t.inputs(pics)
    counts = t.placeholder_counts(inputs["image_grid_thw"])
    ours = t.expand(ids, counts)
    want = processor(text=[text], images=pics, return_tensors="pt")
    assert ours == want["input_ids"][0].tolist()
    assert inputs["image_grid_thw"].tolist() == want["image_grid_thw"].tolist()
    assert sum(counts) == ours.count(tiny_vlm.IMAGE_TOKEN_ID) and all(c > 0 for c in counts)
    with pytest.raises(ValueError, match="image token"):
        t.expand(ids, counts + [4])


def test_the_image_positions_states_come_from_the_vision_tower(target, pictures):
    """The model's input at each image position is the vision tower's output for that image: another image changes
    the states from its first position on, and nothing before it."""
    import torch
    from PIL import Image
    from transformers import Qwen2_5_VLForConditionalGeneration

    folder = pictures[0].parent
    processor = tiny_vlm.load_processor(target)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(target)).eval()
    t = im.TargetImages.load(target)
    states = []
    for name in ("red_circle.png", "blue_square.png"):
        text = processor.tokenizer.apply_chat_template(
            _prompt(folder, name), add_generation_prompt=True, tokenize=False
        )
        ids = processor.tokenizer(text, add_special_tokens=False)["input_ids"]
        inputs = t.inputs([Image.open(folder / name).convert("RGB")])
        ids = t.expand(ids, t.placeholder_counts(inputs["image_grid_thw"]))
        with torch.inference_mode():
            out = model(input_ids=torch.tensor([ids]), **inputs, output_hidden_states=True)
        states.append((ids, out.hidden_states))
    (a, ha), (b, hb) = states
    first = a.index(tiny_vlm.IMAGE_TOKEN_ID)
    assert a[:first] == b[:first] and len(ha) == 5 and ha[-1].shape[-1] == 64
    assert torch.equal(ha[2][0, :first], hb[2][0, :first])
    assert not torch.allclose(ha[0][0, first], hb[0][0, first])  # the embeddings there are the images'


# --- generation and tokenize of an image prompt ---------------------------------------------------------------


def test_a_chat_request_sends_each_image_as_a_data_url_and_a_missing_one_is_a_sample_error(pictures, tmp_path):
    import shutil

    from eagle3_data.backends.chat import build_body
    from eagle3_data.backends.definition import BackendConfig
    from eagle3_data.backends.errors import SampleError

    backend = BackendConfig.from_dict("v", {"type": "openai", "base_url": "http://127.0.0.1:1/v1", "model": "m"})
    shutil.copy(pictures[0], tmp_path / "pic.png")
    messages = _prompt(tmp_path, "pic.png")
    body = build_body(backend, messages, None, {"max_tokens": 5})
    sent = body["messages"][1]["content"][0]
    assert set(sent) == {"type", "image_url"} and sent["image_url"]["url"].startswith("data:image/png;base64,")
    assert body["messages"][0] == messages[0] and body["messages"][1]["content"][1] == messages[1]["content"][1]
    assert json.loads(json.dumps(messages))[1]["content"][0]["image"]  # the prompt itself is not changed
    text_only = [{"role": "user", "content": "hi"}]
    assert build_body(backend, text_only, None, {})["messages"] == text_only
    (tmp_path / "pic.png").unlink()
    with pytest.raises(SampleError) as e:
        build_body(backend, messages, None, {"max_tokens": 5})
    assert e.value.reason == "image_missing"


def test_the_request_key_goes_by_the_images_bytes_not_their_folder(pictures, tmp_path):
    import shutil

    from eagle3_data.files import content_hash
    from eagle3_data.generate.prompts import request_key

    moved = tmp_path / "moved"
    shutil.copytree(pictures[0].parent, moved)
    key = lambda m: request_key("d", "s", 2, "t", m, None, {"max_tokens": 5})  # noqa: E731
    here, there = _prompt(pictures[0].parent, "red_circle.png"), _prompt(moved, "red_circle.png")
    assert here != there and key(here) == key(there)
    assert key(here) != key(_prompt(moved, "blue_square.png"))
    text = [{"role": "user", "content": "hi"}]  # a text prompt's key is what it always was
    assert key(text) == content_hash("d", "s", 2, "t", text, None, {"max_tokens": 5}, length=16)


def test_the_native_path_refuses_an_image_prompt(pictures):
    from eagle3_data.backends.definition import BackendConfig
    from eagle3_data.backends.errors import SampleError
    from eagle3_data.backends.native import encode
    from eagle3_data.backends.request import Request

    backend = BackendConfig.from_dict("s", {"type": "sglang", "base_url": "http://127.0.0.1:1/v1", "model": "m"})
    with pytest.raises(SampleError) as e:
        encode(backend, Request(_prompt(pictures[0].parent, "red_circle.png"), None, {"max_tokens": 5}))
    assert e.value.reason == "image_prompt_native"


def test_tokenize_expands_an_image_prompt_as_the_processor_does_and_supervises_only_the_reply(target, pictures):
    from PIL import Image

    from eagle3_data.templates import load_target_tokens
    from eagle3_data.tokens import tokenize_rows

    folder = pictures[0].parent
    messages = _prompt(folder, "green_triangle.png", "yellow_bar.png")
    row = {
        "sample_id": "s",
        "dataset": "d",
        "turn": 2,
        "status": "ok",
        "messages": json.dumps(messages),
        "tools": None,
        "content": "A triangle and a bar.",
        "reasoning": None,
        "finish_reason": "stop",
        "completion_tokens": 6,
    }
    (out,) = tokenize_rows([row], load_target_tokens(str(target), "auto"))
    assert out["reject_reason"] is None, out["reject_detail"]
    processor = tiny_vlm.load_processor(target)
    finished = messages + [{"role": "assistant", "content": "A triangle and a bar."}]
    text = processor.tokenizer.apply_chat_template(finished, tokenize=False)
    pics = [Image.open(folder / n).convert("RGB") for n in ("green_triangle.png", "yellow_bar.png")]
    want = processor(text=[text], images=pics)["input_ids"][0]
    want = list(want)
    # the template's newline after <|im_end|> is not part of the reply: the target stops at <|im_end|>
    assert out["input_ids"] == want[:-1] and processor.tokenizer.decode(want[-1:]) == "\n"
    pads = [j for j, i in enumerate(out["input_ids"]) if i == tiny_vlm.IMAGE_TOKEN_ID]
    assert len(pads) > 2 and all(out["loss_mask"][j] == 0 for j in pads)
    reply = processor.tokenizer("A triangle and a bar.<|im_end|>", add_special_tokens=False)["input_ids"]
    assert out["num_completion_tokens"] == len(reply) and sum(out["loss_mask"]) == len(reply)
    assert out["input_ids"][-len(reply) :] == reply


def test_tokenize_rejects_an_image_prompt_for_a_text_target_and_a_changed_image(target, pictures, tmp_path):
    import shutil

    from eagle3_data.templates import load_target_tokens
    from eagle3_data.tokens import tokenize_rows

    shutil.copy(pictures[0], tmp_path / "pic.png")
    row = {
        "sample_id": "s",
        "dataset": "d",
        "turn": 2,
        "status": "ok",
        "messages": json.dumps(_prompt(tmp_path, "pic.png")),
        "tools": None,
        "content": "A circle.",
        "reasoning": None,
        "finish_reason": "stop",
        "completion_tokens": 3,
    }
    text_target = tmp_path / "text-target"
    text_target.mkdir()
    for f in target.iterdir():
        if f.name != "preprocessor_config.json":
            shutil.copy(f, text_target / f.name)
    (out,) = tokenize_rows([row], load_target_tokens(str(text_target), "auto"))
    assert out["reject_reason"] == "image_prompt_text_target" and "preprocessor_config.json" in out["reject_detail"]
    shutil.copy(pictures[1], tmp_path / "pic.png")  # other bytes under the same name
    (out,) = tokenize_rows([row], load_target_tokens(str(target), "auto"))
    assert out["reject_reason"] == "image_missing" and "changed since normalize" in out["reject_detail"]
