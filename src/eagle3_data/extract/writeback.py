"""Moving captured states from the forward's tensors into the hidden-states file, overlapped with the next
forward.

Per batch, the stage hands :class:`Writeback` the per-sample ``(aux, final)`` tensors a backend captured. On
the compute device, :meth:`HiddenStateWriter.prepare` casts them to the stored dtype (or quantises them to
fp8); then:

- on CUDA, the bytes are copied into a pinned host buffer on a separate copy stream (``non_blocking``, after
  the forward that made them, ``record_stream`` so the caching allocator does not hand their memory to the next
  forward before the copy is done), and a writer thread waits for the copy's event and puts the rows into the
  file's memory map (:meth:`HiddenStateWriter.put`) while the GPU already runs the next forward. ``depth``
  pinned buffers (default 2: a double buffer) bound the host memory; the stage waits for a free one when the
  writer lags;
- on CPU, the writer thread does the memory-map writes while the main thread runs the next forward;
- every :data:`SYNC_BYTES` written, the writer thread also syncs the file to disk
  (:meth:`HiddenStateWriter.sync`), so the fsync when the file is complete waits for the last bytes only;
- with ``overlap=False`` everything runs in the calling thread, in order (:meth:`HiddenStateWriter.write`): the
  reference the overlapped path must equal byte for byte.

An exception in the writer thread stops it and is raised in the stage's thread at its next :meth:`put` or at
:meth:`close`, so the file's writer removes its temporary file (no partial output). :meth:`abort` stops the
thread before the memory map is closed when the forward fails.

Timings (seconds, :attr:`Writeback.stats`): ``copy_s`` (device-to-host copies: CUDA event time on the copy
stream; on CPU the conversion in the stage's thread), ``write_s`` (the writer thread in memory-map writes and
syncs),
``wait_s`` (the stage's thread blocked on the writeback: no free buffer, a full queue, or draining at the end),
``drain_s`` (the part of ``wait_s`` spent draining in :meth:`close`: the last batches' copies and writes, which no
forward hides).
"""

from __future__ import annotations

import queue
import threading
import time

_ALIGN = 64  # bytes; every part of a pinned buffer starts at a multiple (any dtype view is aligned)
#: the writer thread syncs the file to disk after this many bytes (so the final flush has little left)
SYNC_BYTES = 256 << 20


class Writeback:
    """Overlapped writes of captured states into a :class:`~.layout.HiddenStateWriter` (module docstring).

    Args:
        writer: the open file writer (inside its ``with`` block).
        overlap: ``False``: write in the calling thread (no thread, no pinned buffers).
        depth: batches in flight between the forward and the file (pinned buffers on CUDA).

    Use: ``put(indices, states)`` after each capture, then ``close()`` (waits for every write, raises the writer
    thread's error); on any exception in between, ``abort()``.
    """

    def __init__(self, writer, *, overlap: bool = True, depth: int = 2):
        if depth < 1:
            raise ValueError(f"writeback depth must be >= 1, got {depth}")
        self.writer = writer
        self.overlap = overlap
        self._stream = None  # the copy stream, made at the first put of CUDA tensors
        self.stats = {"copy_s": 0.0, "write_s": 0.0, "wait_s": 0.0, "drain_s": 0.0}
        self._events: list = []  # (start, end) CUDA events of each batch's copies
        self._error: BaseException | None = None
        self._unsynced = 0  # bytes the writer thread put since its last sync
        self._stop = threading.Event()
        self._thread = None
        if not overlap:
            return
        self._todo: queue.Queue = queue.Queue(maxsize=depth)
        self._free: queue.Queue = queue.Queue()
        for _ in range(depth):
            self._free.put(None)  # a pinned buffer slot (allocated, or grown, on first use)
        self._thread = threading.Thread(target=self._run, name="eagle3-writeback", daemon=True)
        self._thread.start()

    # -- stage thread ---------------------------------------------------------------------------------------
    def put(self, indices: list[int], states: list[tuple]) -> None:
        """Queue the states of samples ``indices`` (``[(aux [n_i, A*H], final [n_i, H])]`` tensors, as a
        backend's ``capture`` returns them; a third tensor, the post-norm rows [n_i, H], when the file stores them). Returns once their copies are issued; raises the writer thread's
        error, or RuntimeError for a shape that differs from its sample's."""
        self._raise()
        for i, st in zip(indices, states):
            self.writer.check_shapes(i, st[0].shape, st[1].shape)
        if not self.overlap:
            for i, st in zip(indices, states):
                self.writer.write(i, *st)
            return
        import torch

        t0 = time.perf_counter()
        parts = [self.writer.prepare(*st) for st in states]
        if not parts:
            return
        device = parts[0][0].device
        if device.type != "cuda":
            host = [[t.numpy() for t in p] for p in parts]
            self.stats["copy_s"] += time.perf_counter() - t0
            self._put_item((indices, host, None, None))
            return
        sizes = [[t.numel() * t.element_size() for t in p] for p in parts]
        need = sum(-(-n // _ALIGN) * _ALIGN for row in sizes for n in row)
        buf = self._take_buffer(need)
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=device)
        compute = torch.cuda.current_stream(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        host, pos = [], 0
        with torch.cuda.stream(self._stream):
            self._stream.wait_stream(compute)
            start.record(self._stream)
            for p, row in zip(parts, sizes):
                views = []
                for t, n in zip(p, row):
                    dst = buf[pos : pos + n].view(t.dtype).view(t.shape)
                    dst.copy_(t, non_blocking=True)
                    t.record_stream(self._stream)
                    views.append(dst.numpy())
                    pos += -(-n // _ALIGN) * _ALIGN
                host.append(views)
            end.record(self._stream)
        self._events.append((start, end))
        self._put_item((indices, host, end, buf))

    def close(self) -> None:
        """Wait until every queued sample is in the file; raise the writer thread's error if it had one."""
        if self._thread is not None:
            t0, waited = time.perf_counter(), self.stats["wait_s"]
            self._put_item(None)  # (counts its own wait: replaced below by the whole drain, counted once)
            self._thread.join()
            self._thread = None
            self.stats["drain_s"] = time.perf_counter() - t0
            self.stats["wait_s"] = waited + self.stats["drain_s"]
        self._raise()
        self._collect_copy_times()

    def abort(self) -> None:
        """Stop the writer thread without finishing its queue (the file is being discarded); never raises."""
        self._stop.set()
        if self._thread is not None:
            while True:  # unblock the thread if it waits on a full queue's consumer side
                try:
                    self._todo.get_nowait()
                except queue.Empty:
                    break
            try:
                self._todo.put_nowait(None)
            except queue.Full:
                pass
            self._thread.join()
            self._thread = None

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def _wait_get(self, q: queue.Queue):
        """``q.get()`` that gives up (raising the writer's error) when the writer thread has failed."""
        t0 = time.perf_counter()
        try:
            while True:
                try:
                    return q.get(timeout=0.05)
                except queue.Empty:
                    self._raise()
        finally:
            self.stats["wait_s"] += time.perf_counter() - t0

    def _put_item(self, item) -> None:
        t0 = time.perf_counter()
        try:
            while True:
                try:
                    self._todo.put(item, timeout=0.05)
                    return
                except queue.Full:
                    self._raise()
        finally:
            self.stats["wait_s"] += time.perf_counter() - t0

    def _take_buffer(self, nbytes: int):
        import torch

        buf = self._wait_get(self._free)
        if buf is None or buf.numel() < nbytes:
            del buf
            buf = torch.empty(max(nbytes, _ALIGN), dtype=torch.uint8, pin_memory=True)
        return buf

    def _collect_copy_times(self) -> None:
        if self._events:
            self._events[-1][1].synchronize()
            self.stats["copy_s"] += sum(s.elapsed_time(e) for s, e in self._events) / 1000.0
            self._events = []

    # -- writer thread --------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            item = self._todo.get()
            if item is None or self._stop.is_set():
                return
            indices, host, event, buf = item
            try:
                if event is not None:
                    event.synchronize()
                t0 = time.perf_counter()
                for i, parts in zip(indices, host):
                    self.writer.put(i, parts)
                    self._unsynced += sum(a.nbytes for a in parts)
                if self._unsynced >= SYNC_BYTES:
                    self.writer.sync()
                    self._unsynced = 0
                self.stats["write_s"] += time.perf_counter() - t0
            except BaseException as exc:  # surfaced in the stage's thread
                self._error = exc
                return
            finally:
                if buf is not None:
                    self._free.put(buf)
                del host, item
