"""SGLang extraction backend on CPU: the layer-id mapping per model family (configs only, no weights), the column
order, the capture checks, batching within SGLang's limits, one load per job, and the same file as the
transformers backend through a stand-in that returns what SGLang's logits processor returns. The real SGLang run
is GPU-marked (and ``tests/workflow/test_sglang_contract.py`` checks the backend against the pinned wheel's source)."""

from __future__ import annotations

import itertools
import json
import random
import subprocess
import sys

import pytest
import torch

from eagle3_data.testing.workflow import save_tiny_llama
from eagle3_data import extract as ex
from eagle3_data import schemas
from eagle3_data.settings import ExtractSettings
from eagle3_data.extract import default_layers
from eagle3_data.extract import sglang_backend as sx
from eagle3_data.extract.transformers_backend import load_target

H, L, V = 32, 8, 300
LAYERS = [4, 1, 3]  # unsorted on purpose: SGLang returns ascending blocks, the file keeps this order

# The fields of the public config.json files that extraction reads (no weights).
CONFIGS = {
    "llama": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": 32,
        "hidden_size": 4096,
        "vocab_size": 128256,
    },
    "qwen3": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "num_hidden_layers": 36,
        "hidden_size": 4096,
        "vocab_size": 151936,
    },
    "deepseek-v3": {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "num_hidden_layers": 61,
        "hidden_size": 7168,
        "vocab_size": 129280,
    },
    "kimi-k2.5": {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "text_config": {
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "kimi_k2",
            "num_hidden_layers": 61,
            "hidden_size": 7168,
            "vocab_size": 163840,
        },
        "vision_config": {"vt_num_hidden_layers": 27, "vt_hidden_size": 1152},
    },
}


@pytest.fixture
def config_dir(tmp_path):
    def make(name):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(CONFIGS[name]))
        return d

    return make


def stand_in(tensor_for):
    """A stand-in for a loaded SGLang rank: ``capture(id_lists) -> (aux [T, A*H], final [T, H])`` packed, aux
    blocks in ASCENDING layer order (what ``logits_output.hidden_states`` / ``last_hidden_states`` hold)."""
    return lambda id_lists: tensor_for(id_lists)


# ------------------------------------------------------------------------------------------- layer-id mapping


@pytest.mark.parametrize(
    "name, default_ids, rule",
    [
        ("llama", [1, 15, 28], sx.PLUS_ONE),
        ("qwen3", [1, 17, 32], sx.PLUS_ONE),
        ("deepseek-v3", [1, 29, 57], sx.PLUS_ONE_IF_FIRST_IS_ONE),
        ("kimi-k2.5", [1, 29, 57], sx.PLUS_ONE_IF_FIRST_IS_ONE),
    ],
)
def test_default_layers_map_to_sglang_ids_per_family(config_dir, name, default_ids, rule):
    path = config_dir(name)
    arch = sx.model_architecture(path)
    num_layers = ex.model_dims(path)["num_layers"]
    assert sx.id_rule(arch) == rule
    layers = default_layers(num_layers)
    assert layers == default_ids
    ids = sx.sglang_layer_ids(layers, num_layers=num_layers, architecture=arch)
    # the first default layer is 1: every family gets the layers themselves (DeepSeek/Kimi shift because ids[0] == 1)
    assert ids == default_ids
    assert sx.captured_layers(ids, num_layers=num_layers, rule=rule) == layers
    be = sx.SglangBackend(path, capture=lambda ids: None)
    assert be.layers == layers and be.layer_ids == ids and be.hidden_size == ex.model_dims(path)["hidden_size"]
    assert be._args["return_aux_hidden_state_layer_ids"] == ids


@pytest.mark.parametrize("name", ["deepseek-v3", "kimi-k2.5"])
def test_deepseek_and_kimi_lists_not_starting_at_1_are_shifted_by_us(config_dir, name):
    path = config_dir(name)
    arch = sx.model_architecture(path)
    layers = [2, 30, 58]
    ids = sx.sglang_layer_ids(layers, num_layers=61, architecture=arch)
    assert ids == [3, 31, 59]
    assert sx.captured_layers(ids, num_layers=61, rule=sx.id_rule(arch)) == [2, 30, 58]
    # what passing the layers as they are would silently capture: the previous layers' outputs, right shapes
    assert sx.captured_layers(layers, num_layers=61, rule=sx.id_rule(arch)) == [1, 29, 57]
    assert sx.captured_layers([0, 5], num_layers=61, rule=sx.id_rule(arch)) == [-1, 4]  # -1: the embeddings


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_plus_one_families_map_layer_zero_and_every_list_unchanged(config_dir, name):
    path = config_dir(name)
    arch = sx.model_architecture(path)
    n = ex.model_dims(path)["num_layers"]
    assert sx.sglang_layer_ids([0, 7, 3], num_layers=n, architecture=arch) == [0, 3, 7]
    assert sx.captured_layers([0, 3, 7], num_layers=n, rule=sx.PLUS_ONE) == [0, 3, 7]
    assert sx.sglang_layer_ids([n - 2], num_layers=n, architecture=arch) == [n - 2]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_last_layer_refused_for_every_family_and_layer_zero_for_deepseek_kimi(config_dir, name):
    path = config_dir(name)
    arch = sx.model_architecture(path)
    n = ex.model_dims(path)["num_layers"]
    with pytest.raises(ValueError, match=rf"cannot capture the last decoder layer \({n - 1}\) of {arch}"):
        sx.sglang_layer_ids([1, n - 1], num_layers=n, architecture=arch)
    with pytest.raises(ValueError, match="cannot capture the last decoder layer"):
        sx.SglangBackend(path, layers=[n - 1], capture=lambda ids: None)
    if sx.id_rule(arch) == sx.PLUS_ONE_IF_FIRST_IS_ONE:
        with pytest.raises(ValueError, match=f"cannot capture the output of layer 0 of {arch}"):
            sx.sglang_layer_ids([5, 0], num_layers=n, architecture=arch)
    with pytest.raises(ValueError, match="outside the target's decoder layers"):
        sx.sglang_layer_ids([n], num_layers=n, architecture=arch)


@pytest.mark.parametrize("rule", [sx.PLUS_ONE, sx.PLUS_ONE_IF_FIRST_IS_ONE])
@pytest.mark.parametrize("num_layers", [3, 5, 8])
def test_every_layer_list_round_trips_through_sglangs_rule(rule, num_layers):
    arch = next(a for a, r in sx.ARCHITECTURE_ID_RULES.items() if r == rule)
    checked = 0
    for k in (1, 2, 3):
        for layers in itertools.permutations(range(num_layers), k):
            refused = num_layers - 1 in layers or (rule == sx.PLUS_ONE_IF_FIRST_IS_ONE and 0 in layers)
            if refused:
                with pytest.raises(ValueError):
                    sx.sglang_layer_ids(list(layers), num_layers=num_layers, architecture=arch)
                continue
            ids = sx.sglang_layer_ids(list(layers), num_layers=num_layers, architecture=arch)
            got = sx.captured_layers(ids, num_layers=num_layers, rule=rule)
            assert got == sorted(layers), (layers, ids, got)
            # the file's block k is SGLang's block column_order[k]
            assert [got[j] for j in sx.column_order(list(layers))] == list(layers)
            checked += 1
    assert checked > 0


def test_unknown_family_and_missing_architectures_are_refused(tmp_path):
    cfg = {"architectures": ["GptOssForCausalLM"], "num_hidden_layers": 24, "hidden_size": 64}
    with pytest.raises(ValueError, match="no capture-id rule for architecture 'GptOssForCausalLM'.*LlamaForCausalLM"):
        sx.SglangBackend(cfg, capture=lambda ids: None)
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 4, "hidden_size": 8}))
    with pytest.raises(KeyError, match="config.json has no `architectures`"):
        sx.model_architecture(tmp_path)


def test_server_args_turn_on_sglangs_aux_capture_and_pass_trust_remote_code(config_dir):
    be = sx.SglangBackend(
        config_dir("kimi-k2.5"),
        tp_size=8,
        max_len=4096,
        trust_remote_code=True,
        max_running_requests=64,
        capture=lambda ids: None,
    )
    args = be._args
    assert args["enable_return_aux_hidden_states"] is True and args["speculative_algorithm"] == "EAGLE3"
    assert args["return_aux_hidden_state_layer_ids"] == [1, 29, 57]
    assert args["trust_remote_code"] is True and args["tp_size"] == 8 and args["max_running_requests"] == 64
    assert args["disable_radix_cache"] is True and args["chunked_prefill_size"] == -1
    assert args["context_length"] == 4097 and args["skip_tokenizer_init"] is True
    assert "enable_return_hidden_states" not in args  # the aux capture replaces it; no logits-processor patch
    with pytest.raises(ValueError, match="tp_size"):
        sx.server_args("/m", layer_ids=[1], tp_size=0)
    with pytest.raises(ValueError, match="max_running_requests"):
        sx.server_args("/m", layer_ids=[1], max_running_requests=0)


def test_importable_without_sglang_and_refuses_to_run_without_it(tmp_path):
    code = (
        "import sys; sys.modules['sglang'] = None\n"
        "import eagle3_data.extract.sglang_backend as m; print(m.sglang_available())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
    if not sx.sglang_available():
        (tmp_path / "config.json").write_text(json.dumps(CONFIGS["llama"]))
        with pytest.raises(ImportError, match=f"sglang=={sx.SGLANG_VERSION}"):
            sx.SglangBackend(tmp_path)


# ----------------------------------------------------------------------------- one capture: order, rows, split


def _blocks(layers_ascending, hidden, lens):
    """Packed capture whose block k holds ``layer * 1000 + token`` (final: ``-token``), so every value says
    which layer and which token it is."""
    T = sum(lens)
    tok = torch.arange(T, dtype=torch.float32)[:, None].expand(T, hidden)
    aux = torch.cat([layer * 1000 + tok for layer in layers_ascending], dim=1)
    return aux, -tok.clone()


def test_capture_reorders_blocks_into_layers_order_and_splits_per_sample():
    cfg = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 8, "hidden_size": 4}
    lens = [3, 1, 5]
    be = sx.SglangBackend(cfg, layers=[4, 1, 3], capture=lambda ids: _blocks([1, 3, 4], 4, [len(x) for x in ids]))
    out = be.capture([list(range(n)) for n in lens])
    assert [tuple(a.shape) for a, _ in out] == [(3, 12), (1, 12), (5, 12)]
    start = 0
    for (aux, fin), n in zip(out, lens, strict=True):
        tok = torch.arange(start, start + n, dtype=torch.float32)[:, None]
        for k, layer in enumerate([4, 1, 3]):
            assert torch.equal(aux[:, 4 * k : 4 * (k + 1)], (layer * 1000 + tok).expand(n, 4))
        assert torch.equal(fin, (-tok).expand(n, 4))
        start += n


def test_a_capture_whose_rows_differ_from_the_inputs_is_refused_before_the_split():
    cfg = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 8, "hidden_size": 4}
    short = lambda ids: _blocks([1, 3], 4, [sum(len(x) for x in ids) - 1])  # noqa: E731  (a prefix-cache hit)
    be = sx.SglangBackend(cfg, layers=[1, 3], capture=short)
    with pytest.raises(RuntimeError, match="captured 8 aux / 8 final rows for 2 samples of 9 input tokens"):
        be.capture([[1] * 4, [2] * 5])
    wide = sx.SglangBackend(cfg, layers=[1, 3], capture=lambda ids: _blocks([1, 3, 4], 4, [9]))
    with pytest.raises(RuntimeError, match=r"captured shapes \(9, 12\) / \(9, 4\), expected \(9, 8\) / \(9, 4\)"):
        wide.capture([[1] * 4, [2] * 5])


# ---------------------------------------------------------------------- batches, SGLang's limits, one load per job


class FakeRank(sx.RankBase):
    """A loaded rank with small SGLang limits that records its forwards."""

    def __init__(self, max_requests, max_tokens, layers_ascending, hidden):
        self.max_requests, self.max_tokens, self.context_len = max_requests, max_tokens, 1000
        self.forwards, self.closed, self._layers, self._hidden = [], 0, layers_ascending, hidden

    def forward(self, id_lists):
        self.forwards.append([len(x) for x in id_lists])
        return _blocks(self._layers, self._hidden, [len(x) for x in id_lists])

    def close(self):
        self.closed += 1


def test_batches_are_capped_at_the_running_request_limit():
    cfg = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 8, "hidden_size": 4}
    be = sx.SglangBackend(cfg, max_running_requests=4, capture=lambda ids: None)
    lengths = [3] * 300 + [50, 60]
    batches = be.batches(lengths, 256)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    assert max(len(b) for b in batches) == 4
    assert all(sum(lengths[i] for i in b) <= 256 for b in batches)
    default = sx.SglangBackend(cfg, capture=lambda ids: None)
    assert max(len(b) for b in default.batches([2] * 1000, 100_000)) == sx.DEFAULT_MAX_RUNNING_REQUESTS == 256


def test_forward_spans_stay_within_sglangs_limits():
    assert sx.forward_spans([5, 5, 5], 10, 100) == [(0, 3)]
    assert sx.forward_spans([5, 5, 5, 5, 5], 2, 100) == [(0, 2), (2, 4), (4, 5)]
    assert sx.forward_spans([60, 30, 20, 50], 10, 100) == [(0, 2), (2, 4)]
    assert sx.forward_spans([100, 1], 10, 100) == [(0, 1), (1, 2)]
    with pytest.raises(RuntimeError, match="a sample of 101 tokens does not fit SGLang's KV pool of 100 tokens"):
        sx.forward_spans([5, 101], 10, 100)


def test_model_loaded_once_per_job_and_batches_split_to_the_limits_sglang_settled_on():
    cfg = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 8, "hidden_size": 4}
    made = []

    def factory(tp_rank):
        made.append(tp_rank)
        return FakeRank(max_requests=3, max_tokens=20, layers_ascending=[1, 3], hidden=4)

    be = sx.SglangBackend(cfg, layers=[3, 1], max_running_requests=8, batch_tokens=64, rank_factory=factory)
    lengths = [4, 9, 2, 7, 7, 3, 5, 6, 1, 8]
    batches = be.batches(lengths, 64)
    ids = [[[7] * lengths[i] for i in b] for b in batches]
    be.start(ids)
    be.start(ids)  # idempotent
    outs = [be.capture(b) for b in ids]
    rank = be._rank
    assert made == [0] and be.loads == 1  # one load for the job's batches
    assert len(rank.forwards) > len(batches)  # SGLang's smaller limits split the planned batches
    assert all(len(f) <= 3 and sum(f) <= 20 for f in rank.forwards)
    for b, out in zip(ids, outs, strict=True):
        assert [tuple(a.shape) for a, _ in out] == [(len(x), 8) for x in b]
        for aux, _ in out:  # file order [3, 1] from SGLang's ascending [1, 3]
            assert torch.all(aux[:, :4] >= 3000) and torch.all(aux[:, 4:] < 2000)
    be.close()
    assert rank.closed == 1 and be._rank is None


def test_tensor_parallel_capture_needs_start_first():
    cfg = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 8, "hidden_size": 4}
    be = sx.SglangBackend(cfg, tp_size=2, rank_factory=lambda r: FakeRank(4, 100, [1, 2, 4], 4))
    with pytest.raises(RuntimeError, match="start"):
        be.capture([[1, 2]])


# ------------------------------------------------------------------------- through the stage, on a tiny target


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return save_tiny_llama(
        tmp_path_factory.mktemp("tiny") / "tiny-llama", hidden_size=H, num_layers=L, vocab_size=V, seed=2
    )


@pytest.fixture(scope="module")
def merged(tmp_path_factory):
    rng = random.Random(7)
    rows = []
    for i in range(11):
        n = rng.choice([3, 9, 40, 70])
        p = rng.randint(1, n - 1)
        rows.append(
            {
                "sample_id": f"g{i}",
                "dataset": "d",
                "input_ids": [rng.randrange(V) for _ in range(n)],
                "loss_mask": [0] * p + [1] * (n - p),
                "num_tokens": n,
                "num_supervised": n - p,
                "truncated": False,
            }
        )
    path = tmp_path_factory.mktemp("merged") / "000.parquet"
    schemas.write_checked(schemas.from_rows(rows, schemas.MERGED), "merged", path)
    return path, rows


def hf_capture(model, layers, short_by=0):
    """What SGLang's ragged prefill returns, computed by transformers: one unpadded forward per sample, packed;
    aux blocks of the ASCENDING layers (HF ``hidden_states[i + 1]`` = output of layer i), final = post-norm
    (``hidden_states[-1]``). ``short_by`` drops rows like a prefix-cache hit would."""

    def capture(id_lists):
        aux, fin = [], []
        for ids in id_lists:
            with torch.inference_mode():
                hs = model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
            aux.append(torch.cat([hs[i + 1][0] for i in sorted(layers)], dim=-1))
            fin.append(hs[-1][0])
        aux, fin = torch.cat(aux), torch.cat(fin)
        return aux[short_by:], fin[short_by:]

    return capture


def test_stand_in_writes_the_transformers_file_in_layers_order(tmp_path, tiny_model, merged, monkeypatch):
    path, rows = merged
    loaded = load_target(tiny_model, dtype="float32", device="cpu")
    ref = tmp_path / "hf.safetensors"
    ex.extract_states(
        path,
        ref,  # SGLang stores post-norm final states only: compare with those
        settings=ExtractSettings.defaults(model_path=tiny_model, layers=LAYERS, dtype="float32", final_norm="post"),
        model=loaded,
    )
    seen = {}
    real_init = sx.SglangBackend.__init__

    def spy(self, *a, **kw):
        seen.update(kw)
        real_init(self, *a, **kw)

    monkeypatch.setattr(sx.SglangBackend, "__init__", spy)
    out = tmp_path / "sg.safetensors"
    info = ex.extract_states(
        path,
        out,
        settings=ExtractSettings.defaults(
            model_path=tiny_model,
            layers=LAYERS,
            dtype="float32",
            batch_tokens=100,
            backend="sglang",
            final_norm="post",
            trust_remote_code=True,
        ),
        capture=hf_capture(loaded[0], LAYERS),
    )
    assert seen["trust_remote_code"] is True and seen["layers"] == LAYERS
    assert info["backend"] == "sglang" and info["batches"] > 1
    ta, ma = ex.read_hidden_states(ref)
    tb, mb = ex.read_hidden_states(out)
    for k in ta:
        torch.testing.assert_close(ta[k], tb[k], atol=1e-5, rtol=1e-5)
    assert mb["backend"] == "sglang" and json.loads(mb["layers"]) == json.loads(ma["layers"]) == LAYERS
    assert mb["sample_ids"] == ma["sample_ids"]
    assert mb["state_settings"] != ma["state_settings"]  # rows of one backend are never reused for the other

    # a short capture (prefix-cache symptom) fails the shard and leaves no file
    bad = tmp_path / "bad" / "000.safetensors"
    with pytest.raises(RuntimeError, match="capture length must equal input length"):
        ex.extract_states(
            path,
            bad,
            settings=ExtractSettings.defaults(
                model_path=tiny_model, layers=LAYERS, dtype="float32", backend="sglang", final_norm="post"
            ),
            capture=hf_capture(loaded[0], LAYERS, short_by=1),
        )
    assert not bad.exists() and list(bad.parent.iterdir()) == []
    for norm in ("pre", "both"):
        with pytest.raises(ValueError, match="post-norm final states only: set extract.final_norm: post"):
            ex.extract_states(
                path,
                bad,
                settings=ExtractSettings.defaults(
                    model_path=tiny_model, backend="sglang", final_norm=norm, dtype="float32"
                ),
            )
    with pytest.raises(ValueError, match="cannot capture the last decoder layer"):
        ex.extract_states(
            path,
            bad,
            settings=ExtractSettings.defaults(
                model_path=tiny_model, layers=[1, L - 1], backend="sglang", final_norm="post", dtype="float32"
            ),
            capture=hf_capture(loaded[0], [1, L - 1]),
        )
