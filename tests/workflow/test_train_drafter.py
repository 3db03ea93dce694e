"""README step 9: a drafter trains on this build's exports with the trainers' own training code.

The exports are those of ``tests/workflow/test_trainers.py``'s fixtures (the real small target, SmolLM2-135M-Instruct,
and its own greedy replies, tokenized by the tokenize stage), extracted once in bfloat16, the extract dtype of the
real-run configs (``resources/configs/openrouter.yaml``: SpecForge 0.2.0 reads nothing else), and exported in the
``speculators`` and ``specforge`` layouts. The commands are read from README.md and run through the trainers' own
entry points, in a process of their own, for two optimizer steps on the CPU
(:mod:`eagle3_data.testing.cpu_training`); README step 9 lists every difference from the commands as written:

- speculators 0.9.0: ``speculators.train.cli.main`` with the README's flags, for its EAGLE-3, DFlash and DSpark
  drafters on the same ``speculators`` export. Its own metrics: the loss falls from the first step to the second,
  both finite, and the checkpoint of each epoch is written with different weights.
- SpecForge 0.2.0: ``specforge.cli.main`` with ``train --config resources/train/specforge-eagle3.yaml`` and
  ``section.field=value`` overrides, on the ``specforge`` export, the draft vocabulary the vocab stage's code
  writes. Its own step metrics: the loss falls, both finite; its checkpoint is written.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eagle3_data import export as exp
from eagle3_data import extract as ex
from eagle3_data import schemas
from eagle3_data.export.inplace_specforge import write_ref_manifest
from eagle3_data.files import write_parquet
from eagle3_data.settings import ExportSettings, ExtractSettings, VocabSettings
from eagle3_data.testing.workflow import ROOT
from eagle3_data.vocab import build_vocab, token_frequencies
from test_readme_commands import fenced_commands
from test_trainers import loaded, real_target, rows  # noqa: F401 - the trainer tests' fixtures

STEPS = 2
#: a small draft vocabulary for SpecForge on the CPU, where bfloat16 matrix products are emulated
SPECFORGE_DRAFT_VOCAB = 64


def readme_command(start: str) -> str:
    """The one fenced command of README.md that starts with ``start``."""
    found = [c.text for c in fenced_commands(ROOT / "README.md") if c.text.startswith(start)]
    assert len(found) == 1, f"README.md: {len(found)} commands start with {start!r}"
    return found[0]


def with_flags(argv: list[str], **flags) -> list[str]:
    """``argv`` with each ``--flag value`` of ``flags`` (``snake_case`` names; None: a bare switch) replaced, or
    appended where ``argv`` lacks it."""
    out = list(argv)
    for name, value in flags.items():
        flag = "--" + name.replace("_", "-")
        if flag in out:
            i = out.index(flag)
            has_value = i + 1 < len(out) and not out[i + 1].startswith("--")
            del out[i : i + 1 + has_value]
        out += [flag] if value is None else [flag, str(value)]
    return out


def train(trainer: str, argv: list[str], tmp_path: Path, timeout: int = 1200) -> list[dict]:
    """``argv`` through :mod:`eagle3_data.testing.cpu_training` in a process of its own, in ``tmp_path``; returns
    the trainer's metrics of each optimizer step."""
    metrics = tmp_path / f"{trainer}-metrics.json"
    proc = subprocess.run(
        [sys.executable, "-m", "eagle3_data.testing.cpu_training", trainer, str(metrics), *argv],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 0, f"{trainer} {shlex.join(argv)}:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    return json.loads(metrics.read_text())["steps"]


def assert_learns(steps: list[dict]) -> None:
    assert len(steps) == STEPS, steps
    losses = [s["loss"] for s in steps]
    assert all(math.isfinite(x) and x > 0 for x in losses), losses
    assert losses[-1] < losses[0], f"the loss did not fall: {losses}"


@pytest.fixture(scope="module")
def exports(tmp_path_factory, request):
    """The trainer tests' ``rows`` extracted once with bfloat16 states (the eagle3 layers, ``final_norm: both``)
    and exported in the ``speculators`` (a data path, with the vocab stage's token frequencies) and ``specforge``
    layouts, and in their in-place forms (``speculators_inplace``, ``specforge_inplace``: no states copied);
    ``target``: the real target's directory."""
    target, model = request.getfixturevalue("real_target"), request.getfixturevalue("loaded")
    plain = [{k: v for k, v in r.items() if k != "prompt_len"} for r in request.getfixturevalue("rows")]
    tmp = tmp_path_factory.mktemp("bf16")
    merged = tmp / "merged" / "000.parquet"
    schemas.write_checked(schemas.from_rows(plain, schemas.MERGED), "merged", merged)
    settings = ExtractSettings.defaults(model_path=str(target), dtype="bfloat16")
    selections = {}
    for src in sorted({r["source"] for r in plain}):
        sel = tmp / "selection" / f"{src}.parquet"
        schemas.write_checked(
            schemas.from_rows([r for r in plain if r["source"] == src], schemas.MERGED), "merged", sel
        )
        ex.extract_states(
            sel, tmp / "states" / f"{src}.safetensors", selection_digest=src, model=model, settings=settings
        )
        selections[src] = {"digest": src}
    manifest = {"shards": [{"samples": len(plain)}], "selections": selections}
    out = {"target": Path(target), "merged": merged, "tokens": sum(r["num_tokens"] for r in plain)}
    for layout in ("speculators", "specforge", "speculators_inplace", "specforge_inplace"):
        out[layout] = tmp / layout
        m = exp.export(
            merged,
            out[layout],
            layout=layout,
            states_dir=tmp / "states",
            merge_manifest=manifest,
            settings=ExportSettings.defaults(),
        )
        assert m["num_samples"] == len(plain)
    freq = tmp / "freq.parquet"
    write_parquet(token_frequencies([merged]), freq)
    exp.write_speculators_dataset(out["speculators"], token_frequencies=freq)
    exp.write_speculators_dataset(out["speculators_inplace"], token_frequencies=freq)
    write_ref_manifest(out["specforge_inplace"])
    ckpt = torch.load(next(out["specforge"].rglob("data_0.ckpt")), weights_only=True)
    assert ckpt["hidden_state"].dtype == ckpt["aux_hidden_state"].dtype == torch.bfloat16
    return out


# --- speculators ------------------------------------------------------------------------------------------


SPECULATORS_CPU = dict(
    draft_attn_impl="sdpa",  # FlexAttention has no backward on a CPU
    loss_implementation="eager",  # the fused loss is a Triton kernel
    hidden_states_dtype="float32",  # the states are read into float32 (bfloat16 is emulated on this CPU)
    optimizer="adamw",  # Muon's Newton-Schulz steps run in bfloat16: 40 s a step here
    lr="1e-4",  # AdamW at speculators' 1e-3 overshoots on the first step (no warm-up in two steps)
    num_workers=0,
    epochs=STEPS,
    max_steps=STEPS,
)


def speculators_argv(target: Path, data: Path, save: Path, total_tokens: int, **extra) -> list[str]:
    """README step 9's speculators command: its flags after ``-m speculators.train``, with the test's target,
    data and output paths, a total sequence length that holds every sample (one batch per epoch, so the two
    steps see the same samples) and :data:`SPECULATORS_CPU`."""
    words = shlex.split(readme_command("torchrun "))
    argv = words[words.index("speculators.train") + 1 :]
    assert "--data-path" in argv and "--verifier-name-or-path" in argv, argv
    return with_flags(
        argv,
        verifier_name_or_path=target,
        data_path=data,
        save_path=save,
        total_seq_len=total_tokens,
        **SPECULATORS_CPU,
        **extra,
    )


@pytest.mark.parametrize(
    "drafter, extra",
    [
        ("eagle3", {}),
        # one draft layer and 16 anchors instead of 5 and 512: the DFlash family's eager attention on a CPU
        ("dflash", {"num_layers": 1, "max_anchors": 16}),
        ("dspark", {"num_layers": 1, "max_anchors": 16}),
    ],
)
def test_speculators_trains_a_drafter_on_the_export(exports, drafter, extra, tmp_path):
    from safetensors.torch import load_file

    data = tmp_path / "speculators"  # speculators caches its vocab mapping in the data path: a copy
    shutil.copytree(exports["speculators"], data)
    save = tmp_path / "out"
    argv = speculators_argv(exports["target"], data, save, exports["tokens"], speculator_type=drafter, **extra)
    assert_learns(train("speculators", argv, tmp_path))
    # the draft vocabulary it built from the export's token_freq.pt, cached beside the data
    assert (data / "d2t-32000.npy").exists() and (data / "t2d-32000.npy").exists()
    # a checkpoint per epoch, in speculators' format, for the verifier it was trained against
    config = json.loads((save / "1" / "config.json").read_text())
    assert config["speculators_model_type"] == drafter
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(exports["target"])
    # speculators' default target layers, [2, L//2, L - 3] of hidden_states: the outputs of the layers exported
    L = json.loads((exports["target"] / "config.json").read_text())["num_hidden_layers"]
    layers = config.get("eagle_aux_hidden_state_layer_ids") or config.get("aux_hidden_state_layer_ids")
    assert layers == [2, L // 2, L - 3]
    first, last = (load_file(save / e / "model.safetensors") for e in ("0", "1"))
    trained = [k for k in first if first[k].is_floating_point() and not torch.equal(first[k], last[k])]
    assert trained, "no weight changed between the two checkpoints"


def in_place_copy(src: Path, dest: Path) -> Path:
    """A copy of the in-place directory ``src`` whose ``inplace.json`` still finds the states (an absolute path)."""
    shutil.copytree(src, dest)
    info = json.loads((dest / "inplace.json").read_text())
    info["states_dir"] = str((src / info["states_dir"]).resolve())
    (dest / "inplace.json").write_text(json.dumps(info))
    return dest


def test_speculators_trains_the_same_on_the_states_read_in_place(exports, tmp_path):
    """speculators' own train command on the speculators_inplace data path (``--hidden-states-backend eagle3_data``,
    no hs_*.safetensors anywhere) takes the very steps it takes on the copied files: the same losses, bit for bit,
    and the same weights at the end."""
    from safetensors.torch import load_file

    runs = {}
    for name, src in (("copied", exports["speculators"]), ("in_place", exports["speculators_inplace"])):
        data = tmp_path / name / "data"  # speculators caches its vocab mapping in the data path: a copy
        if name == "in_place":
            in_place_copy(src, data)
            assert not (data / "hidden_states").exists()
        else:
            shutil.copytree(src, data)
        extra = {"hidden_states_backend": "eagle3_data"} if name == "in_place" else {}
        argv = speculators_argv(exports["target"], data, tmp_path / name / "out", exports["tokens"], **extra)
        runs[name] = train("speculators", argv, tmp_path / name)
    assert_learns(runs["in_place"])
    assert [s["loss"] for s in runs["in_place"]] == [s["loss"] for s in runs["copied"]]
    a, b = (load_file(tmp_path / n / "out" / "1" / "model.safetensors") for n in ("copied", "in_place"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


# --- SpecForge --------------------------------------------------------------------------------------------


def specforge_target(target: Path, dest: Path) -> Path:
    """The real target as SpecForge 0.2.0's ``TargetHead`` reads one (``specforge/modeling/target/target_head.py``):
    ``lm_head.weight`` found through a ``*.index.json``. SmolLM2 ties it to the embeddings in a single
    ``model.safetensors``; the copy holds the tied matrix under both names, and the index."""
    from safetensors.torch import load_file, save_file

    dest.mkdir(parents=True)
    for f in target.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dest / f.name)
    weights = load_file(target / "model.safetensors")
    assert "lm_head.weight" not in weights and json.loads((dest / "config.json").read_text())["tie_word_embeddings"]
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    shard = "model-00001-of-00001.safetensors"
    save_file(weights, dest / shard, metadata={"format": "pt"})
    (dest / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": dict.fromkeys(weights, shard)})
    )
    return dest


def specforge_draft_config(target: Path, path: Path, draft_vocab: int) -> Path:
    """A one-layer EAGLE-3 draft config in SpecForge's format (its ``configs/*-eagle3.json``: the target's
    ``config.json`` with ``architectures: [LlamaForCausalLMEagle3]``, untied, ``draft_vocab_size``)."""
    cfg = json.loads((target / "config.json").read_text())
    cfg.update(
        architectures=["LlamaForCausalLMEagle3"],
        num_hidden_layers=1,
        tie_word_embeddings=False,
        draft_vocab_size=draft_vocab,
    )
    path.write_text(json.dumps(cfg, indent=1))
    return path


def test_specforge_trains_a_drafter_on_the_export(exports, tmp_path):
    words = shlex.split(readme_command("specforge train "))
    config = ROOT / words[words.index("--config") + 1]
    target = specforge_target(exports["target"], tmp_path / "target")
    vocab = tmp_path / "vocab_mapping.pt"  # the vocab stage's file, at the small draft vocabulary
    build_vocab(
        [exports["merged"]],
        vocab,
        settings=VocabSettings.defaults(draft_vocab_size=SPECFORGE_DRAFT_VOCAB, model_path=str(target)),
    )
    out = tmp_path / "out"
    overrides = {
        "model.target_model_path": target,
        "model.embedding_key": "model.embed_tokens.weight",  # the Llama names (Kimi K2.5's sit under language_model.)
        "model.lm_head_key": "lm_head.weight",
        "model.vocab_mapping_path": vocab,
        "model.draft_model_config": specforge_draft_config(target, tmp_path / "draft.json", SPECFORGE_DRAFT_VOCAB),
        "data.hidden_states_path": exports["specforge"],
        "data.cache_dir": tmp_path / "cache",
        "training.attention_backend": "sdpa",  # flex_attention has no backward on a CPU
        "training.fsdp_sharding": "NO_SHARD",  # FSDP needs an accelerator; NO_SHARD trains under DDP (gloo here)
        "training.batch_size": len(list(exports["specforge"].rglob("*.ckpt"))),  # every sample in each step
        "training.num_epochs": STEPS,
        "training.max_steps": STEPS,
        "output_dir": out,
        "deployment.trainer.nproc_per_node": 1,
    }
    argv = words[1:] + [f"{k}={v}" for k, v in overrides.items()]
    argv[argv.index("--config") + 1] = str(config)
    assert_learns(train("specforge", argv, tmp_path))
    assert (out / f"{_run_id(config)}-step{STEPS}" / "training_state.pt").exists(), sorted(
        p.name for p in out.iterdir()
    )


def _run_id(config: Path) -> str:
    import yaml

    return yaml.safe_load(config.read_text())["run_id"]


def test_specforge_trains_on_the_states_read_in_place(exports, tmp_path):
    """SpecForge's own train command, through ``python -m eagle3_data.export.inplace_specforge``, with the shipped
    in-place config (resources/train/specforge-eagle3-inplace.yaml: its disaggregated offline consumer reading the
    specforge_inplace ref manifest through this package's feature store; no data_{i}.ckpt anywhere) trains a
    drafter: the loss falls, its checkpoint is written, and its steps are those of the colocated run on the copied
    files (README step 9's config, the test above) to float32 rounding."""
    config = ROOT / "resources/train/specforge-eagle3-inplace.yaml"
    target = specforge_target(exports["target"], tmp_path / "target")
    vocab = tmp_path / "vocab_mapping.pt"
    build_vocab(
        [exports["merged"]],
        vocab,
        settings=VocabSettings.defaults(draft_vocab_size=SPECFORGE_DRAFT_VOCAB, model_path=str(target)),
    )
    data = in_place_copy(exports["specforge_inplace"], tmp_path / "specforge_inplace")
    assert not list(data.rglob("*.ckpt")) and (data / "manifest.json.done").is_file()
    out = tmp_path / "out"
    overrides = {
        "model.target_model_path": target,
        "model.embedding_key": "model.embed_tokens.weight",
        "model.lm_head_key": "lm_head.weight",
        "model.vocab_mapping_path": vocab,
        "model.draft_model_config": specforge_draft_config(target, tmp_path / "draft.json", SPECFORGE_DRAFT_VOCAB),
        "data.hidden_states_path": data,
        "data.cache_dir": tmp_path / "cache",
        "deployment.disaggregated.control_dir": data,
        "deployment.disaggregated.store_root": data,
        "training.attention_backend": "sdpa",
        "training.fsdp_sharding": "NO_SHARD",
        "training.batch_size": len(json.loads((data / "manifest.json").read_text())["refs"]),
        "training.num_epochs": STEPS,
        "training.max_steps": STEPS,
        "output_dir": out,
        "deployment.trainer.nproc_per_node": 1,
    }
    argv = ["train", "--config", str(config)] + [f"{k}={v}" for k, v in overrides.items()]
    steps = train("specforge", argv, tmp_path)
    assert_learns(steps)
    assert (out / f"{_run_id(config)}-step{STEPS}" / "training_state.pt").exists(), sorted(
        p.name for p in out.iterdir()
    )
    assert not list(data.rglob("*.ckpt"))  # nothing was put into a store: the states were read where they are
    copied = {k: v for k, v in overrides.items() if not k.startswith("deployment.disaggregated")}
    copied.update({"data.hidden_states_path": exports["specforge"], "output_dir": tmp_path / "copied"})
    words = shlex.split(readme_command("specforge train "))
    argv = words[1:] + [f"{k}={v}" for k, v in copied.items()]
    argv[argv.index("--config") + 1] = str(ROOT / words[words.index("--config") + 1])
    (tmp_path / "colocated").mkdir()
    want = train("specforge", argv, tmp_path / "colocated")
    assert [s["loss"] for s in steps] == pytest.approx([s["loss"] for s in want], rel=1e-6)
