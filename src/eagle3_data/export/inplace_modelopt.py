"""NVIDIA Model-Optimizer reads the extracted states in place: a streaming dataset of its own kind that fetches each
sample from ``results/hidden_states/`` instead of a server (no ``{i}.pt`` copy).

Model-Optimizer 0.47's ``modelopt/torch/speculative/plugins/hf_streaming_dataset.py`` is built to be subclassed: its
``StreamingDataset`` owns the map-style plumbing (the resample-forward ``__getitem__``, the consecutive-miss circuit
breaker, the ``EagleFetchPayload`` check) and a subclass gives ``_fetch`` (where the states come from) and
``_format`` (the EAGLE-3 batch: ``EagleVllmStreamingDataset._format``). :class:`InPlaceStreamingDataset` is that
subclass:

- its entries are the ``modelopt_inplace`` export directory's side tables ``samples_*.parquet`` (``sample_id``,
  ``input_ids``, ``loss_mask``, ``source``), so nothing is tokenized again: the ids and mask are the build's;
- ``_fetch`` reads the sample from its selection's states file (``inplace.json``: :mod:`.inplace_states`):
  ``token_ids`` [T] int64, ``hidden_states`` [T, A+1, H] (the A auxiliary layers, then the post-norm final state, in
  the extract dtype) and ``loss_mask`` [T] int64; None while the file is not there (or holds another selection's
  states), which Model-Optimizer treats as a fetch miss: it takes the next index that has its states;
- ``_format`` is Model-Optimizer's own EAGLE-3 one with ``base_hidden_prenorm`` False (the states are post-norm, as
  the ``modelopt`` files): the batch equals ``OfflineSupervisedDataset``'s on the ``modelopt`` export
  (``answer_only_loss``) bit for bit.

Training before extraction ends: a sample whose states file is not there is a miss, so a trainer started during
extraction trains on the finished shards' samples and finds each new file when it next asks for one of its samples
(a missing file is looked for again every :data:`~.inplace_states.RECHECK_S` seconds). The circuit breaker
(``fail_after_consecutive_skips``) defaults here to the corpus size + 1, so only a corpus with no states at all stops
the trainer (Model-Optimizer's RuntimeError: "no fetchable sample found in the entire corpus").
"""

from __future__ import annotations

import os

import torch
from modelopt.torch.speculative.plugins.hf_streaming_dataset import (
    EagleFetchPayload,
    EagleVllmStreamingDataset,
    StreamingConfig,
    StreamingDataset,
)
from pydantic import Field

from .inplace_states import RECHECK_S, InPlaceStates, side_rows
from .layouts import speculators_tensors


class InPlaceStreamingConfig(StreamingConfig):
    """:class:`InPlaceStreamingDataset`'s settings: Model-Optimizer's ``StreamingConfig`` plus the in-place
    directory (``data_path``) and the two keys its EAGLE-3 ``_format`` reads."""

    data_path: str
    recheck_s: float = Field(default=RECHECK_S, ge=0)
    base_hidden_prenorm: bool = False
    final_aux_is_base_hidden: bool = False


class InPlaceStreamingDataset(StreamingDataset):
    """Model-Optimizer's streaming EAGLE-3 dataset over the in-place directory ``config.data_path`` (module
    docstring). Build it with :meth:`from_data_path`. ``__getitem__(i)`` returns Model-Optimizer's per-sample batch:
    ``input_ids`` [T] int64, ``base_model_hidden_states`` [T, H], ``aux_hidden_states`` [T, A*H],
    ``attention_mask``, ``loss_mask`` [T] int64, ``labels`` [T] and ``base_hidden_prenorm``."""

    config_cls = InPlaceStreamingConfig
    fetch_payload_cls = EagleFetchPayload
    _format = EagleVllmStreamingDataset._format

    def __init__(self, entries: list[dict], tokenizer=None, config: InPlaceStreamingConfig | None = None):
        if config is None:
            raise ValueError("InPlaceStreamingDataset needs its config (data_path): use from_data_path")
        super().__init__(entries=entries, tokenizer=tokenizer, config=config)
        self.states = InPlaceStates(config.data_path, config.recheck_s)
        if self.states.final != "post" or config.base_hidden_prenorm:
            raise ValueError(
                f"{config.data_path}: serves the {self.states.final}-norm final state; Model-Optimizer's EAGLE-3 "
                "format reads it post-norm here (base_hidden_prenorm False)"
            )

    @classmethod
    def from_data_path(cls, data_path: str | os.PathLike, **config) -> "InPlaceStreamingDataset":
        """The dataset of every sample of ``data_path`` (a ``modelopt_inplace`` export directory), in index order;
        ``config``: other :class:`InPlaceStreamingConfig` keys (``max_seq_len``, ...). Raises ValueError when the
        side tables' indices are not ``0..N-1``."""
        rows = side_rows(data_path, ["index", "sample_id", "source", "input_ids", "loss_mask"])
        entries = [{"conversation_id": r["sample_id"], **r} for r in rows]
        settings = {"fail_after_consecutive_skips": len(entries) + 1, **config}
        return cls(entries, None, InPlaceStreamingConfig(data_path=str(data_path), **settings))

    def _tokenize_entry(self, entry: dict) -> dict | None:
        """The entry's own ids and mask (the build's: nothing is tokenized), cut to ``max_seq_len``; None when
        nothing of it is supervised (Model-Optimizer's rule)."""
        n = self.config.max_seq_len or len(entry["input_ids"])
        mask = torch.tensor(entry["loss_mask"][:n], dtype=torch.long)
        if int(mask.sum()) == 0:
            return None
        return {
            "cid": entry["conversation_id"],
            "token_ids": entry["input_ids"][:n],
            "loss_mask": mask,
            "source": entry["source"],
        }

    def _fetch(self, sample: dict) -> dict | None:
        """``{"token_ids" [T] int64, "hidden_states" [T, A+1, H], "loss_mask" [T] int64}`` of ``sample``, from its
        selection's states file; None while that file is not there. Raises ValueError when the file holds other
        token ids (Model-Optimizer's "token drift" is a fault, not a miss)."""
        f = self.states.file(sample["source"])
        if f is None:
            return None
        t = speculators_tensors(self.states.sample(f, sample["cid"], "its entry"))
        n = len(sample["token_ids"])
        if not torch.equal(t["token_ids"][:n], torch.as_tensor(sample["token_ids"], dtype=torch.int64)):
            raise ValueError(f"{f.path}: sample {sample['cid']!r} holds other token ids than its side table")
        return {
            "token_ids": t["token_ids"][:n],
            "hidden_states": t["hidden_states"][:n],
            "loss_mask": sample["loss_mask"],
        }
