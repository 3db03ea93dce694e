"""Image prompts through every stage (issue 46): the shipped ``resources/configs/images.yaml`` (the bundled
LLaVA-style records and pictures on the tiny random Qwen2.5-VL the build makes) run by Snakemake in a scratch copy of
the workflow. Each kept row's ids are transformers' own processor's for the finished conversation, with loss mask 0 on
every image position; speculators' own loader reads the export, and its states at every position are the model's
with the pictures through its vision tower. A picture changed under the same name and size reruns only what depends
on it: its row is forwarded again, the others are reused."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from eagle3_data import tiny_vlm
from eagle3_data.testing.workflow import copy_workflow, run_snakemake

torch = pytest.importorskip("torch")
pytest.importorskip("speculators")

CONFIG = ("--configfile", "resources/configs/images.yaml")


@pytest.fixture(scope="module")
def image_run(tmp_path_factory):
    wd = copy_workflow(tmp_path_factory.mktemp("images") / "wf")
    run_snakemake(wd, "--cores", "2", *CONFIG)
    return wd


def _reference(model, processor, folder, row_messages: list, reply: str):
    """The processor's ids of the finished conversation (without the template's newline after the reply) and the
    model's hidden states on them with the pictures (``output_hidden_states``: index i = output of layer i - 1)."""
    from PIL import Image

    finished = row_messages + [{"role": "assistant", "content": reply}]
    text = processor.tokenizer.apply_chat_template(finished, tokenize=False)
    parts = [p for m in row_messages if isinstance(m["content"], list) for p in m["content"]]
    pics = [Image.open(folder / p["image_url"]["url"]).convert("RGB") for p in parts if p["type"] == "image_url"]
    enc = processor(text=[text], images=pics or None, return_tensors="pt")
    ids = enc["input_ids"][0, :-1]
    assert processor.tokenizer.decode(enc["input_ids"][0, -1:]) == "\n"
    inputs = {k: v[:, :-1] if k in ("input_ids", "attention_mask", "mm_token_type_ids") else v for k, v in enc.items()}
    with torch.inference_mode():
        out = model.model(**inputs, output_hidden_states=True, use_cache=False)
    return ids.tolist(), out.hidden_states


def test_image_prompts_go_through_every_stage_exact_and_read_by_speculators(image_run):
    from speculators.train.data import ArrowDataset
    from transformers import AutoModelForImageTextToText

    wd = image_run
    target = wd / "results/target/tiny-qwen2.5-vl"
    rejects = pq.read_table(wd / "results/llava_demo/rejected/normalize.parquet").to_pylist()
    assert sorted(r["reason"] for r in rejects) == ["image_marker_mismatch", "image_missing"]
    validated = pq.read_table(wd / "results/llava_demo/validated/000.parquet").to_pylist()
    responses = {r["sample_id"]: r for r in pq.read_table(wd / "results/llava_demo/responses/000.parquet").to_pylist()}
    assert len(validated) == 6 and sum(1 for r in validated if r["images"]) == 5
    processor = tiny_vlm.load_processor(target)
    model = AutoModelForImageTextToText.from_pretrained(str(target), dtype=torch.float32).eval()
    meta = json.loads((wd / "results/hidden_states/llava_demo/000.json").read_text())
    assert meta["image_rows"] == 5 and meta["forwarded_samples"] == 6
    layers = meta["layers"]
    H = model.config.text_config.hidden_size
    ds = ArrowDataset(
        max_len=4096,
        datapath=str(wd / "results/export/speculators"),
        on_missing="raise",
        hidden_states_dtype=torch.float32,
    )
    assert len(ds) == 6
    by_ids = {tuple(ds[i]["input_ids"].tolist()): ds[i] for i in range(len(ds))}
    seen_vision = False
    for r in validated:
        resp = responses[r["sample_id"]]
        messages = json.loads(resp["messages"])
        want, states = _reference(model, processor, wd, messages, resp["content"])
        assert r["input_ids"] == want  # exact: the processor's own expansion of every image
        ids, mask = r["input_ids"], r["loss_mask"]
        for im in json.loads(r["images"] or "[]"):
            s, n = im["start"], im["length"]
            assert ids[s : s + n] == [tiny_vlm.IMAGE_TOKEN_ID] * n and set(mask[s : s + n]) == {0}
            assert ids[s - 1] == tiny_vlm.VISION_START_ID and ids[s + n] == tiny_vlm.VISION_END_ID
        assert ids.count(tiny_vlm.IMAGE_TOKEN_ID) == sum(im["length"] for im in json.loads(r["images"] or "[]"))
        item = by_ids[tuple(ids)]  # speculators' loader: the same ids, mask and the model's states
        assert item["loss_mask"].tolist() == mask
        assert item["hidden_states"].shape == (len(ids), len(layers) * H)
        for k, layer in enumerate(layers):
            torch.testing.assert_close(
                item["hidden_states"][:, k * H : (k + 1) * H], states[layer + 1][0], atol=1e-4, rtol=1e-4
            )
        with torch.inference_mode():
            normed = model.model.language_model.norm(item["verifier_last_hidden_states"])
        torch.testing.assert_close(normed, states[-1][0], atol=1e-4, rtol=1e-4)
        if r["images"]:  # the pictures mattered: the same ids without them give other states
            with torch.inference_mode():
                blind = model.model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
            s = json.loads(r["images"])[0]["start"]
            seen_vision |= not torch.allclose(blind[layers[-1] + 1][0, s:], states[layers[-1] + 1][0, s:], atol=1e-3)
    assert seen_vision


def test_a_picture_changed_under_its_name_reruns_only_its_row(image_run, tmp_path):
    import shutil

    from PIL import Image, ImageDraw

    wd = tmp_path / "wf"
    shutil.copytree(image_run, wd, symlinks=True)
    proc = run_snakemake(wd, "--cores", "2", *CONFIG)
    assert "Nothing to be done" in proc.stdout + proc.stderr
    before = pq.read_table(wd / "results/llava_demo/validated/000.parquet").to_pylist()
    pic = wd / "resources/samples/images/red_circle.png"
    im = Image.new("RGB", (80, 60), "white")  # the same size: the same ids, another picture
    ImageDraw.Draw(im).rectangle((20, 10, 60, 50), fill="red")
    im.save(pic, format="PNG")
    # the pictures are no rule inputs (the rows name them): the change is picked up from normalize on
    run_snakemake(wd, "--cores", "2", *CONFIG, "--forcerun", "normalize_llava_demo")
    after = pq.read_table(wd / "results/llava_demo/validated/000.parquet").to_pylist()
    changed = [a for a, b in zip(after, before) if a["images"] != b["images"]]
    assert [json.loads(a["images"])[0]["url"] for a in changed] == ["resources/samples/images/red_circle.png"]
    assert [a["input_ids"] for a in after] == [b["input_ids"] for b in before]  # same ids: the digest decides
    meta = json.loads((wd / "results/hidden_states/llava_demo/000.json").read_text())
    assert meta["forwarded_samples"] == 1 and meta["reused_samples"] == 5
