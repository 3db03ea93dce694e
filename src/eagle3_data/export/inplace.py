"""speculators reads the extracted states in place: a hidden-states backend for speculators 0.9.0 that serves each
sample straight from ``results/hidden_states/`` (no ``hs_{i}.safetensors`` copy), shard by shard as extraction
finishes them.

The ``speculators_inplace`` export layout writes a speculators data directory without states: the side tables
``samples_{start}.parquet`` (``index``, ``sample_id``, ``dataset``, ``input_ids``, ``loss_mask``, ``seq_len`` and
``source``, the selection whose states file holds the sample), the arrow dataset speculators' ``ArrowDataset``
loads (rule ``export_dataset``) and ``inplace.json`` (:data:`INDEX_FILE`: where the states files are and the merge's
digest of each selection). It needs the merge only, not the extraction, so it is written before any extract job
ends.

:class:`InPlaceTransfer` is an ``hs_connectors.HiddenStatesTransfer`` (hs-connectors 0.9.0,
``hs_connectors/transfer.py``): ``get_cached(i)`` returns ``{"hidden_states": [T, A+1, H], "token_ids": [T]}``, the
tensors the ``speculators`` file export writes for sample ``i`` (its auxiliary layers, then its pre-norm final
state, in the extract dtype; fp8-stored states dequantized as the export does), bit for bit; or None while the
sample's states file is not there yet (or holds another selection's states: it is being re-extracted). A missing
file is looked for again at most every :data:`RECHECK_S` seconds, so a trainer started during extraction picks up
each shard as its extract job renames the file into place; speculators' ``--on-missing skip`` (or ``warn``)
passes over the samples not extracted yet meanwhile.

:class:`InPlaceBackend` registers it with hs_connectors under :data:`BACKEND` (``@HiddenStatesBackend.register``).
The registry is per process, so this module must be imported before speculators builds its data: train with
``python -m eagle3_data.export.inplace train --data-path results/export/speculators_inplace
--hidden-states-backend eagle3_data ...`` (the rest as ``python -m speculators train``), or import it first in
your own script.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from hs_connectors import HiddenStatesBackend, HiddenStatesTransfer

from .inplace_states import INDEX_FILE, RECHECK_S, InPlaceStates  # noqa: F401  (INDEX_FILE: this module's API)
from .layouts import speculators_tensors

#: the backend's name in hs_connectors' registry (``--hidden-states-backend``)
BACKEND = "eagle3_data"


class InPlaceTransfer(HiddenStatesTransfer):
    """Sample ``i`` of the in-place data directory ``data_path`` (:class:`InPlaceStates`), read from its selection's
    states file."""

    def __init__(self, data_path: str | os.PathLike, recheck_s: float = RECHECK_S):
        self.states = InPlaceStates(data_path, recheck_s)
        self.data_path = self.states.data_path

    def get_cached(self, file_idx: int) -> dict[str, torch.Tensor] | None:
        """Sample ``file_idx``'s ``{"hidden_states": [T, A+1, H], "token_ids": [T] int64}``, or None while its
        states file is not there (or not this merge's). Raises IndexError for an index the side tables lack and
        ValueError when the file holds no layers of the layout's drafter or the sample's ids differ from the
        file's."""
        index, ids, sources = self.states.side()
        if not 0 <= file_idx < len(index) or index[file_idx].as_py() != file_idx:
            raise IndexError(f"{self.data_path}: no sample {file_idx} in its samples_*.parquet tables")
        f = self.states.file(sources[file_idx].as_py())
        if f is None:
            return None
        return speculators_tensors(self.states.sample(f, ids[file_idx].as_py(), f"index {file_idx}"))

    def get_generated(self, hs_transfer_params: dict[str, Any]) -> dict[str, torch.Tensor] | None:
        """Not served: the states come from the build's extraction, never from a live vLLM request."""
        return None


class InPlaceBackend(HiddenStatesBackend):
    """``--hidden-states-backend eagle3_data``: the states of an in-place data directory (``--data-path``)."""

    @staticmethod
    def add_train_args(parser) -> None:
        """No arguments of its own: ``--data-path``'s ``inplace.json`` says where the states are."""

    @staticmethod
    def add_launch_args(parser) -> None:
        """Nothing to launch: the states are extracted by the build."""

    @staticmethod
    def from_train_args(args, data_path: str) -> InPlaceTransfer:
        return InPlaceTransfer(data_path)

    @staticmethod
    def build_kv_transfer_config(args) -> dict[str, Any]:
        raise ValueError("the eagle3_data backend serves states extracted by the build; it takes none from vLLM")


def main(argv: list[str] | None = None) -> None:
    """``python -m eagle3_data.export.inplace <speculators arguments>``: speculators' own command line
    (``python -m speculators``) with this backend registered."""
    import sys

    from speculators.cli import app

    sys.argv = [sys.argv[0], *(argv if argv is not None else sys.argv[1:])]
    app()


if __name__ != "__main__":
    HiddenStatesBackend.register(BACKEND)(InPlaceBackend)
else:  # python -m: the classes of the importable module, so DataLoader workers can unpickle the transfer
    from eagle3_data.export.inplace import main as _main

    _main()
