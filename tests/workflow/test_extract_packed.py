"""Packed extraction (samples concatenated in one row, block-diagonal causal attention) gives the states of the
padded path and of one sample at a time, computes no padding, and the overlapped writeback writes the same bytes
as writing in order (tiny random Llama, fp32, CPU)."""

from __future__ import annotations

import ctypes
import platform
import random
import threading
import time

import numpy as np
import pytest
import torch

from eagle3_data.testing.workflow import save_tiny_llama
from eagle3_data import extract as ex
from eagle3_data import schemas
from eagle3_data.errors import DiskError
from eagle3_data.settings import ExtractSettings
from eagle3_data.extract import layout
from eagle3_data.extract import transformers_backend as tb

H, L, V, MAX_LEN = 32, 6, 300, 512  # MAX_LEN: the tiny target's max_position_embeddings
LAYERS = [0, 2, 4]  # not L-1: HF's output_hidden_states[L] is the final norm's output


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return save_tiny_llama(
        tmp_path_factory.mktemp("tiny") / "tiny-llama", hidden_size=H, num_layers=L, vocab_size=V, seed=3
    )


@pytest.fixture(scope="module")
def loaded(tiny_model):
    return tb.load_target(tiny_model, dtype="float32", device="cpu")


def make_rows(lengths, seed=0):
    rng = random.Random(seed)
    rows = []
    for i, n in enumerate(lengths):
        p = rng.randint(0, n - 1)
        rows.append(
            {
                "sample_id": f"p{i}",
                "dataset": "d",
                "input_ids": [rng.randrange(V) for _ in range(n)],
                "loss_mask": [0] * p + [1] * (n - p),
                "num_tokens": n,
                "num_supervised": n - p,
                "truncated": False,
            }
        )
    return rows


#: a sample of length 1 (twice), one of MAX_LEN, and many short ones that share packed batches
LENGTHS = [5, 1, MAX_LEN, 17, 130, 2, 64, 1, 300, 33, 7, 90, 3]


@pytest.fixture(scope="module")
def selection(tmp_path_factory):
    rows = make_rows(LENGTHS)
    path = tmp_path_factory.mktemp("sel") / "000.parquet"
    schemas.write_checked(schemas.from_rows(rows, schemas.MERGED), "merged", path)
    return path, rows


class InputCounter:
    """Tokens entering the decoder per forward (padding included): what the model computes."""

    def __init__(self, decoder):
        self.per_forward: list[int] = []
        self.handle = decoder.register_forward_pre_hook(self.hook, with_kwargs=True)

    def hook(self, module, args, kwargs):
        self.per_forward.append(int(kwargs["input_ids"].numel()))

    def remove(self):
        self.handle.remove()


def test_packed_equals_padded_equals_one_by_one(tmp_path, tiny_model, loaded, selection):
    path, rows = selection
    T = sum(LENGTHS)
    settings = ExtractSettings.defaults(tiny_model, layers=LAYERS, dtype="float32", final_norm="post")
    runs = {}
    counter = InputCounter(loaded[1])
    try:
        for name, attention, batch_tokens in [
            ("one_by_one", "padded", 1),
            ("padded", "padded", 700),
            ("packed", "packed", 700),
            ("auto", "auto", 700),
        ]:
            counter.per_forward = []
            out = tmp_path / f"{name}.safetensors"
            info = ex.extract_states(
                path, out, model=loaded, settings=settings.replace(attention=attention, batch_tokens=batch_tokens)
            )
            runs[name] = (info, ex.read_hidden_states(out), list(counter.per_forward))
    finally:
        counter.remove()

    one, padded, packed, auto = (runs[k] for k in ("one_by_one", "padded", "packed", "auto"))
    assert one[0]["batches"] == len(rows) and one[0]["attention"] == "padded"
    assert packed[0]["attention"] == "packed:loop"
    # auto on CPU is the packed layout: the same forwards and the same bytes as an explicit packed
    assert auto[0]["attention"] == "packed:loop" and auto[2] == packed[2]
    assert auto[1][1] == packed[1][1]
    for k, v in packed[1][0].items():
        assert torch.equal(auto[1][0][k], v), k
    # packed: each forward holds only real tokens: MAX_LEN alone (the next sample would pass the budget of
    # 700), then the 12 others together; padded computes padding
    assert packed[2] == [MAX_LEN, T - MAX_LEN] and packed[0]["batches"] == 2
    assert sum(padded[2]) > T and sum(one[2]) == T
    # the same file, value for value (fp32: rounding only), and identical ids, masks, offsets, metadata
    (t1, m1), (tp, mp), (tk, mk) = one[1], padded[1], packed[1]
    assert m1 == mp == mk
    for k in ("input_ids", "loss_mask", "sample_offsets"):
        assert torch.equal(t1[k], tk[k]) and torch.equal(t1[k], tp[k])
    for k in ("aux_hidden_states", "hidden_states"):
        torch.testing.assert_close(tp[k], t1[k], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(tk[k], t1[k], rtol=1e-5, atol=1e-5)
    # and each equals the plain HF forward of its sample (output_hidden_states[i + 1]) - the length-1 and the
    # MAX_LEN samples included
    off = tk["sample_offsets"].tolist()
    model = loaded[0]
    for n in (LENGTHS.index(1), LENGTHS.index(MAX_LEN), LENGTHS.index(300)):
        with torch.inference_mode():
            hs = model(input_ids=torch.tensor([rows[n]["input_ids"]]), output_hidden_states=True).hidden_states
        s, e = off[n], off[n + 1]
        assert e - s == LENGTHS[n]
        for j, layer in enumerate(LAYERS):
            torch.testing.assert_close(
                tk["aux_hidden_states"][s:e, j * H : (j + 1) * H], hs[layer + 1][0], rtol=1e-5, atol=1e-5
            )
        torch.testing.assert_close(tk["hidden_states"][s:e], hs[-1][0], rtol=1e-5, atol=1e-5)
    assert model.config._attn_implementation == "sdpa"  # the packed backend switched it back


def test_flex_kernel_equals_per_sample_attention(tiny_model, loaded):
    """The FlexAttention kernel with the document block mask (eager on CPU: the GPU compiles the same call)."""
    ids = [np.random.default_rng(n).integers(0, V, n) for n in (1, 140, 9, 1, 129)]  # rows cross 128-blocks
    out = {}
    for attention in ("packed-flex", "packed-loop"):
        be = tb.TransformersBackend(tiny_model, layers=LAYERS, loaded=loaded, attention=attention)
        try:
            out[attention] = be.capture(ids)
        finally:
            be.close()
    for (a, f), (a2, f2), x in zip(out["packed-flex"], out["packed-loop"], ids):
        assert a.shape == (len(x), 3 * H) and f.shape == (len(x), H)
        torch.testing.assert_close(a, a2, rtol=1e-5, atol=5e-5)  # eager flex sums in another order
        torch.testing.assert_close(f, f2, rtol=1e-5, atol=5e-5)


def test_packed_batches_take_real_tokens(tiny_model, loaded):
    be = tb.TransformersBackend(tiny_model, layers=LAYERS, loaded=loaded, attention="packed")
    try:
        assert (be.layout, be.kernel, be.attention) == ("packed", "loop", "packed:loop")
        batches = be.batches(LENGTHS, 700)
        assert sorted(i for b in batches for i in b) == list(range(len(LENGTHS)))
        assert all(sum(LENGTHS[i] for i in b) <= 700 for b in batches)
        # longest first: MAX_LEN alone (the next sample would pass 700), then all the others (653 tokens)
        assert batches == [[2], [8, 4, 11, 6, 9, 3, 10, 0, 12, 5, 1, 7]]
        # a capture cuts the packed row back into its samples, each exactly its length
        ids = [np.arange(n) % V for n in (1, 7, 3)]
        out = be.capture(ids)
        assert [tuple(a.shape) for a, _ in out] == [(1, 3 * H), (7, 3 * H), (3, 3 * H)]
        assert [tuple(f.shape) for _, f in out] == [(1, H), (7, H), (3, H)]
    finally:
        be.close()
    assert loaded[0].config._attn_implementation == "sdpa"


def test_attention_modes_resolve_per_device(monkeypatch):
    assert tb.resolve_attention("auto", "cpu", "float32") == ("packed", "loop")
    assert tb.resolve_attention("auto", "cpu", "bfloat16", 128) == ("packed", "loop")
    assert tb.resolve_attention("padded", "cuda", "bfloat16") == ("padded", "")
    assert tb.resolve_attention("packed", "cpu", "bfloat16") == ("packed", "loop")
    assert tb.resolve_attention("packed-flex", "cpu", "float32") == ("packed", "flex")
    monkeypatch.setattr(tb, "_flash_available", lambda: True)
    assert tb.resolve_attention("auto", "cuda", "bfloat16", 128) == ("packed", "varlen")
    assert tb.resolve_attention("packed", "cuda", "float32", 128) == ("packed", "flex")  # flash: bf16/fp16 only
    assert tb.resolve_attention("packed", "cuda", "bfloat16", 512) == ("packed", "flex")  # head size > 256
    monkeypatch.setattr(tb, "_flash_available", lambda: False)
    assert tb.resolve_attention("auto", "cuda", "float16", 128) == ("packed", "flex")
    with pytest.raises(ValueError, match="packed-varlen needs CUDA"):
        tb.resolve_attention("packed-varlen", "cpu", "bfloat16")
    with pytest.raises(ValueError, match="attention must be one of"):
        tb.resolve_attention("ragged", "cuda", "bfloat16")


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (n, ctypes.c_size_t)
        for n in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt / mallinfo2")
def test_cpu_backend_keeps_freed_host_memory(tiny_model, loaded):
    """After a CPU backend starts, a 16 MiB tensor comes from malloc's heap, not from a fresh mapping (whose
    pages would fault in on first touch), while one over the threshold is still mapped."""
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = _MallInfo2
    be = tb.TransformersBackend(tiny_model, layers=LAYERS, loaded=loaded, attention="auto")
    be.close()
    assert tb.keep_freed_host_memory() is True  # set once; again: still True
    before = libc.mallinfo2().hblkhd  # bytes in mmapped chunks
    held = torch.empty(16 << 20, dtype=torch.uint8)
    assert libc.mallinfo2().hblkhd == before
    big = torch.empty(tb.HOST_MMAP_THRESHOLD + (1 << 20), dtype=torch.uint8)
    assert libc.mallinfo2().hblkhd >= before + tb.HOST_MMAP_THRESHOLD
    del held, big


def test_bad_attention_is_rejected_before_any_work(tmp_path, tiny_model, selection):
    with pytest.raises(ValueError, match="attention must be one of"):
        ex.extract_states(
            selection[0],
            tmp_path / "x.safetensors",
            settings=ExtractSettings.defaults(model_path=tiny_model, attention="ragged", dtype="float32"),
        )
    assert not (tmp_path / "x.safetensors").exists()


def test_packing_refuses_models_it_cannot_express(tiny_model, loaded, monkeypatch):
    from transformers import MistralConfig, MistralForCausalLM

    assert tb.packed_unsupported(loaded[0]) == ""
    windowed = MistralForCausalLM(
        MistralConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=V,
            sliding_window=16,
        )
    )
    assert "sliding" in tb.packed_unsupported(windowed)
    with pytest.raises(ValueError, match="sliding"):
        tb.TransformersBackend(tiny_model, loaded=(windowed, windowed.model), attention="packed")
    be = tb.TransformersBackend(tiny_model, loaded=(windowed, windowed.model), attention="auto")
    assert be.layout == "padded"
    be.close()
    monkeypatch.setattr(type(loaded[0]), "_supports_attention_backend", False)
    assert "AttentionInterface" in tb.packed_unsupported(loaded[0])


def test_a_layer_skipping_the_packed_attention_is_caught(tiny_model, loaded, monkeypatch):
    """A model whose layer computes attention its own way would mix samples in a packed row: refused."""
    be = tb.TransformersBackend(tiny_model, layers=LAYERS, loaded=loaded, attention="packed")
    try:
        layer = loaded[1].layers[3]
        monkeypatch.setattr(layer.self_attn, "forward", lambda hidden_states, **kw: (hidden_states * 0, None))
        with pytest.raises(RuntimeError, match="ran 5 times for 6 decoder layers"):
            be.capture([np.arange(4), np.arange(9)])
    finally:
        be.close()
    with pytest.raises(RuntimeError, match="outside a packed"):
        tb.packed_attention(None, torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2), None)


@pytest.mark.parametrize("lengths", [[1, 7, 130, 64, 3, 200], [128, 128, 1], [300], [5] * 60, [127, 1, 129, 256]])
def test_document_block_mask_is_block_diagonal_causal(lengths):
    from torch.nn.attention.flex_attention import create_block_mask

    T = sum(lengths)
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    ref = create_block_mask(lambda b, h, q, kv: (doc[q] == doc[kv]) & (q >= kv), None, None, T, T, device="cpu")
    mine = tb.document_block_mask(lengths, "cpu")
    assert torch.equal(mine.to_dense(), ref.to_dense())
    dense = torch.zeros(T, T, dtype=torch.bool)
    s = 0
    for n in lengths:
        dense[s : s + n, s : s + n] = torch.tril(torch.ones(n, n, dtype=torch.bool))
        s += n
    # the element mask (mask_mod on the blocks it is evaluated on) is exactly block-diagonal causal
    from torch.nn.attention.flex_attention import create_mask

    assert torch.equal(create_mask(mine.mask_mod, None, None, T, T, device="cpu")[0, 0], dense)


def test_document_block_mask_skips_blocks_across_samples():
    # four samples of exactly one block each: only the 4 diagonal blocks are computed (masked), none full
    m = tb.document_block_mask([128] * 4, "cpu")
    assert m.kv_num_blocks.sum().item() == 4 and m.full_kv_num_blocks.sum().item() == 0
    # one sample of 4 blocks: 4 diagonal blocks masked, the 6 below the diagonal computed without a mask
    m = tb.document_block_mask([512], "cpu")
    assert m.kv_num_blocks.sum().item() == 4 and m.full_kv_num_blocks.sum().item() == 6
    with pytest.raises(ValueError, match="lengths"):
        tb.document_block_mask([3, 0], "cpu")


# -- overlapped writeback ------------------------------------------------------------------------------------


@pytest.mark.parametrize("savers", [{}, {"final_states": "supervised", "aux_format": "fp8_e4m3"}])
def test_overlapped_writes_equal_in_order_writes(tmp_path, tiny_model, loaded, selection, savers, monkeypatch):
    from eagle3_data.extract import writeback

    path, _ = selection
    syncs = []
    real_sync = layout.HiddenStateWriter.sync
    monkeypatch.setattr(layout.HiddenStateWriter, "sync", lambda self: (syncs.append(1), real_sync(self)))
    monkeypatch.setattr(writeback, "SYNC_BYTES", 1)  # the writer thread syncs after every batch
    kw = dict(
        model=loaded,
        settings=ExtractSettings.defaults(
            tiny_model, layers=LAYERS, attention="packed", batch_tokens=400, dtype="float32", **savers
        ),
    )
    a, b = tmp_path / "overlap.safetensors", tmp_path / "inorder.safetensors"
    ia = ex.extract_states(path, a, overlap=True, **kw)
    assert len(syncs) == ia["batches"]
    ib = ex.extract_states(path, b, overlap=False, **kw)
    assert a.read_bytes() == b.read_bytes()
    assert ia["batches"] == ib["batches"] > 2
    t = ia["timing"]
    assert t["forward_s"] > 0 and t["write_s"] > 0 and t["flush_s"] >= 0 and t["wait_s"] >= 0
    assert ib["timing"]["write_s"] == 0.0  # in order: nothing left for a writer thread


def _writeback_threads():
    return [t for t in threading.enumerate() if t.name == "eagle3-writeback"]


def test_writer_thread_error_surfaces_and_leaves_no_file(tmp_path, tiny_model, loaded, selection, monkeypatch):
    path, _ = selection
    calls = {"n": 0}
    real = layout.HiddenStateWriter.put

    def failing(self, i, parts):
        calls["n"] += 1
        if calls["n"] == 4:
            raise OSError(28, "No space left on device (simulated)")
        return real(self, i, parts)

    monkeypatch.setattr(layout.HiddenStateWriter, "put", failing)
    out = tmp_path / "hs" / "000.safetensors"
    out.parent.mkdir()
    with pytest.raises(DiskError, match=r"cannot write .*000\.safetensors: the disk is full"):
        ex.extract_states(
            path,
            out,
            settings=ExtractSettings.defaults(
                model_path=tiny_model, layers=LAYERS, attention="packed", batch_tokens=100, dtype="float32"
            ),
            model=loaded,
        )
    assert calls["n"] == 4  # the writer stopped at its error
    assert list(out.parent.iterdir()) == []  # no output, no temporary file
    assert _writeback_threads() == []


def test_forward_error_stops_the_writer_and_leaves_no_file(tmp_path, tiny_model, loaded, selection, monkeypatch):
    path, _ = selection
    calls = {"n": 0}
    real = tb.TransformersBackend.capture

    def failing(self, id_lists):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("CUDA error: an illegal memory access (simulated)")
        return real(self, id_lists)

    monkeypatch.setattr(tb.TransformersBackend, "capture", failing)
    out = tmp_path / "hs" / "000.safetensors"
    out.parent.mkdir()
    with pytest.raises(RuntimeError, match="illegal memory access"):
        ex.extract_states(
            path,
            out,
            settings=ExtractSettings.defaults(
                model_path=tiny_model, layers=LAYERS, attention="packed", batch_tokens=100, dtype="float32"
            ),
            model=loaded,
        )
    assert list(out.parent.iterdir()) == [] and _writeback_threads() == []
    assert loaded[0].config._attn_implementation == "sdpa"


def test_writeback_rejects_a_wrong_length_before_queueing(tmp_path, selection):
    from eagle3_data.extract.writeback import Writeback

    shard = layout.TokenShard(selection[0])
    w = layout.HiddenStateWriter(
        tmp_path / "w.safetensors",
        shard,
        hidden_size=4,
        num_aux=2,
        dtype="float32",
        final_states="all",
        aux_format="same",
        metadata={},
    )
    with pytest.raises(RuntimeError, match="capture length must equal input length"):
        with w:
            sink = Writeback(w)
            try:
                n = shard.lengths[0]
                sink.put([0], [(torch.zeros(n + 1, 8), torch.zeros(n + 1, 4))])
            finally:
                sink.abort()
    assert not (tmp_path / "w.safetensors").exists()


def test_writeback_wait_counts_each_blocked_second_once(tmp_path, selection, monkeypatch):
    """With a writer slower than the stage, the stage's thread blocks in ``put`` (queue full) and at ``close``
    (draining): ``wait_s`` sums those disjoint intervals once each, so it stays within the wall time from the
    first ``put`` to the end of ``close``; ``drain_s`` is the part spent in ``close``."""
    from eagle3_data.extract.writeback import Writeback

    shard = layout.TokenShard(selection[0])
    real = layout.HiddenStateWriter.put

    def slow(self, i, parts):
        time.sleep(0.03)
        return real(self, i, parts)

    monkeypatch.setattr(layout.HiddenStateWriter, "put", slow)
    w = layout.HiddenStateWriter(
        tmp_path / "w.safetensors",
        shard,
        hidden_size=4,
        num_aux=2,
        dtype="float32",
        final_states="all",
        aux_format="same",
        metadata={},
    )
    with w:
        sink = Writeback(w)  # depth 2: the third put waits for the writer
        t0 = time.perf_counter()
        for i, n in enumerate(shard.lengths):
            sink.put([i], [(torch.full((n, 8), float(i)), torch.full((n, 4), -float(i)))])
        sink.close()
        wall = time.perf_counter() - t0
    s = sink.stats
    assert s["write_s"] >= 0.03 * shard.n
    assert 0.03 * (shard.n - 3) <= s["wait_s"] <= wall  # every blocked second counted once, none twice
    assert 0.03 <= s["drain_s"] <= s["wait_s"]
    aux = ex.load_states(tmp_path / "w.safetensors")[0]["aux_hidden_states"]
    assert aux[shard.offsets[-2] :, 0].tolist() == [float(shard.n - 1)] * shard.lengths[-1]
