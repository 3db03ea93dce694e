"""The states of an in-place export directory (``speculators_inplace``, ``specforge_inplace``): where its states
files are and which sample each index is (:class:`InPlaceStates`), for the trainers' readers in :mod:`.inplace`
(speculators) and :mod:`.inplace_specforge` (SpecForge). No trainer is imported here."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from ..extract.layout import StatesFile
from .layouts import drafter_of
from .writer import read_side_tables

#: the file of an in-place data directory that says where its states are
INDEX_FILE = "inplace.json"
#: seconds between two looks for a states file that was not there
RECHECK_S = 10.0


def side_rows(out_dir, columns: list[str]) -> list[dict]:
    """The rows of the export directory ``out_dir``'s side tables, ``columns`` of each (``index`` among them), in
    global index order (:func:`.writer.read_side_tables`, which raises ValueError for a missing shard)."""
    table = read_side_tables(out_dir, columns)
    return [] if table is None else table.to_pylist()


class InPlaceStates:
    """The states files of the in-place data directory ``data_path`` (an in-place layout's export directory).

    ``data_path/inplace.json`` gives ``states_dir`` (``<states_dir>/<source>.safetensors`` holds selection
    ``source``; relative to ``data_path``), ``layout``, ``final`` (the final-state form served) and ``selections``
    (``{source: digest}``, the merge's); the side tables ``samples_*.parquet`` give each index's ``sample_id`` and
    ``source``. Files are opened on first use in each process (a DataLoader worker opens its own); a missing one is
    looked for again at most every ``recheck_s`` seconds. Shared by the speculators backend (:class:`InPlaceTransfer`)
    and SpecForge's store (:mod:`.inplace_specforge`)."""

    def __init__(self, data_path: str | os.PathLike, recheck_s: float = RECHECK_S):
        self.data_path = Path(data_path)
        info = json.loads((self.data_path / INDEX_FILE).read_text())
        states_dir = Path(info["states_dir"])
        self.states_dir = states_dir if states_dir.is_absolute() else (self.data_path / states_dir).resolve()
        self.layout = info["layout"]
        self.final = info.get("final", "pre")
        self.selections: dict = info.get("selections") or {}
        self.recheck_s = float(recheck_s)
        self._rows = None
        self._files: dict[str, StatesFile] = {}
        self._missing: dict[str, float] = {}

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.update(_files={}, _missing={}, _rows=None)  # memory maps stay in the process that opened them
        return state

    def side(self):
        """The side tables' ``index``, ``sample_id`` and ``source`` columns, in index order (read once)."""
        if self._rows is None:
            t = read_side_tables(self.data_path, ["index", "sample_id", "source"])
            if t is None:
                raise FileNotFoundError(f"{self.data_path}: no samples_*.parquet side tables (export it first)")
            self._rows = (t.column("index"), t.column("sample_id"), t.column("source"))
        return self._rows

    def file(self, source: str) -> StatesFile | None:
        """Selection ``source``'s states file, or None while it is not there (or holds another selection's states:
        it is being re-extracted)."""
        f = self._files.get(source)
        if f is not None:
            return f
        if time.monotonic() < self._missing.get(source, float("-inf")):
            return None
        path = self.states_dir / f"{source}.safetensors"
        if path.is_file():
            f = StatesFile(path)
            want = (self.selections.get(source) or {}).get("digest")
            if want is None or f.meta.get("selection_digest") == want:
                self._files[source] = f
                self._missing.pop(source, None)
                return f
            f.close()  # another selection's states: being re-extracted
        self._missing[source] = time.monotonic() + self.recheck_s
        return None

    def sample(self, f: StatesFile, sample_id: str, what: str) -> dict:
        """``StatesFile.sample`` of ``sample_id`` in ``f``: the layout's drafter's layers, in its final-state form.
        Raises ValueError when ``f`` holds no layers of the layout's drafter or no such sample (``what`` names the
        sample in the message)."""
        drafter = drafter_of(self.layout, f.drafter_layers)
        if drafter is None:
            raise ValueError(f"{f.path}: holds the layers of {sorted(f.drafter_layers)}, not eagle3's")
        j = f.index.get(sample_id)
        if j is None:
            raise ValueError(f"{f.path}: no sample {sample_id!r} ({what} of {self.data_path})")
        return f.sample(j, final=self.final, layers=f.drafter_layers[drafter])
