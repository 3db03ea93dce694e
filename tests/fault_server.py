"""A fault-injecting OpenAI/OpenRouter-compatible chat-completions server for tests and benchmarks.

Plain asyncio HTTP/1.1 (keep-alive, Content-Length bodies) so it serves thousands of concurrent connections
from one process without extra dependencies. A Starlette + uvicorn port (same API; branch issue13-progress, commit
3598a46) was measured with ``benchmarks/generation_client.py`` (10,000 requests, 2,000 in flight, loaded 2-core
machine): it served them all (1,999 in flight) at 2.8 ms of server CPU per request against 1.6 ms here (28.0 s vs
16.1 s; ``--toy``: 0.46 s vs 0.18 s), but with it ``tests/test_generate_kill.py::test_sigterm_mid_run_...`` failed
2 runs in 5 (the job ignored SIGTERM and finished; 0 in 9 with this server): kept until that is understood.
Endpoints:

- ``POST /v1/chat/completions``: a deterministic reply (text derived from a hash of the request body), with
  faults drawn at the configured rates: ``p429`` (with ``Retry-After``), ``p5xx`` (500/502/503), ``ptimeout``
  (hangs ``hang_s`` then closes), ``preset`` (TCP reset), ``perror200`` (200 with ``choices[0].error`` +
  ``finish_reason: "error"``), ``pmalformed`` (200 with a truncated JSON body), ``p402``, ``psurrogate`` (200
  whose content ends in an unpaired ``\\ud800``), ``pbadusage`` (200 with a NaN cost, a 1e30 prompt count, a
  negative reasoning count and an out-of-range token id; counted as completed); ``fail_after``
  (every request after that many gets HTTP ``fail_status``, e.g. 402, with body ``fail_body`` when set);
  ``require_key`` (401 unless the
  Bearer token matches). Latency: uniform in ``[latency_min_s, latency_max_s]``. Reply length: uniform in
  ``[min_tokens, max_tokens]`` words, capped by the request's ``max_tokens`` (then ``finish_reason:
  "length"``). ``usage`` has prompt/completion/reasoning tokens and ``cost`` (``price_in``/``price_out`` per
  token); ``provider`` is set (OpenRouter style); ``reasoning_field`` picks ``reasoning`` (OpenRouter) or
  ``reasoning_content`` (SGLang) for a short reasoning text (``reasoning_tokens`` words; 0 = none).
  ``omit_cost`` leaves ``usage.cost`` out (the client may then look it up by generation id).
  ``require_tool_reasoning`` enforces Moonshot's thinking-mode rule: HTTP 400 "thinking is enabled but
  reasoning_content is missing in assistant tool call message" when an assistant message with ``tool_calls`` has
  no ``reasoning_content`` (absent or null).
- ``GET /v1/generation?id=gen-...`` (OpenRouter cost lookup): ``{"data": {"id", "total_cost", ...}}`` for an id
  this server completed, after ``cost_404s`` 404 answers per id (stats appear late); 404 for unknown ids.
- ``POST /generate`` (SGLang native): body ``{"input_ids", "sampling_params": {"max_new_tokens", ...}}``; replies
  ``{"text", "output_ids", "meta_info": {"id", "finish_reason": {"type": "stop"|"length", ...},
  "prompt_tokens", "completion_tokens"}}``. ``output_ids`` are deterministic in the request: ``gen_think``
  ``[open_id, close_id]`` (optional; ``open_id`` null when the prompt opens the block) wraps ``reasoning_tokens`` ids, then ``[min_tokens, max_tokens]`` content ids,
  all drawn from ``gen_vocab``, then ``gen_eot`` (when set and ``gen_include_stop``); cut at ``max_new_tokens``
  (``length``). ``text`` maps ids < 256 to their byte (the tiny target's vocabulary). ``gen_abort_rate``: share
  of ``finish_reason: abort`` replies. Faults apply as for chat.
- Every POST body and its non-secret headers are kept (the last ``record_bodies``) in ``FaultApp.bodies`` /
  ``FaultApp.headers`` (``GET /admin/bodies``); the ``authorization`` header is reduced to ``present``.
- ``GET /health``: 200 ``{"status": "ok"}``.
- ``GET /stats``: counters: ``requests``, ``outcomes`` (by fault), ``completed`` (200-ok replies sent),
  ``completed_by_body`` (request-body hash -> ok replies sent; >1 means the client paid twice),
  ``in_flight``, ``max_in_flight``, ``cpu_s`` (the server process's CPU seconds),
  ``connections`` (TCP connections accepted).
- ``POST /admin/config`` (JSON: keys above), ``POST /admin/reset`` (zero counters).

Run: ``python tests/fault_server.py --port 8000 [--config '{"p429": 0.1}'] [--startup-delay 1]``, or in a
test: ``FaultServer(config).start()`` (background thread) ... ``.stop()``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import random
import socket
import struct
import threading
import time

DEFAULTS = {
    "p429": 0.0, "p5xx": 0.0, "ptimeout": 0.0, "preset": 0.0, "perror200": 0.0, "pmalformed": 0.0, "p402": 0.0,
    "psurrogate": 0.0, "pbadusage": 0.0,
    "retry_after_s": 0.05, "hang_s": 30.0, "fail_after": None, "fail_status": 402, "fail_body": None,
    "require_key": None,
    "latency_min_s": 0.0, "latency_max_s": 0.0, "min_tokens": 5, "max_tokens": 40,
    "price_in": 1e-7, "price_out": 2e-6, "provider": "FaultProvider", "reasoning_field": "reasoning",
    "reasoning_tokens": 0, "seed": 0, "model": None,
    "latency_dist": "uniform", "latency_by_body": False,
    "record_bodies": 50, "omit_cost": False, "cost_404s": 0,
    "gen_vocab": list(range(97, 123)) + [32], "gen_think": None, "gen_eot": None, "gen_include_stop": True,
    "gen_abort_rate": 0.0, "require_tool_reasoning": False,
}

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau "
         "upsilon phi chi psi omega").split()


def body_hash(body: dict) -> str:
    """Hash of the request content that identifies 'the same request' (model excluded: backend-specific)."""
    keep = {k: v for k, v in body.items() if k not in ("model", "stream")}
    return hashlib.blake2b(json.dumps(keep, sort_keys=True).encode(), digest_size=12).hexdigest()


def latency_of(config: dict, bh: str | None, rng: random.Random | None = None) -> float:
    """Latency for a request: ``latency_dist`` uniform in ``[latency_min_s, latency_max_s]``, or lognormal with
    its 1st..99th percentile spanning that range (clipped to it). ``bh`` (a body hash) seeds the draw when given."""
    lo, hi = float(config["latency_min_s"]), float(config["latency_max_s"])
    if hi <= 0:
        return 0.0
    r = random.Random("latency:" + bh) if bh is not None else (rng or random)
    if config.get("latency_dist", "uniform") == "lognormal" and lo > 0:
        mu = (math.log(lo) + math.log(hi)) / 2
        sigma = (math.log(hi) - math.log(lo)) / (2 * 2.326)  # 2.326 = z of the 99th percentile
        return min(hi, max(lo, r.lognormvariate(mu, sigma)))
    return r.uniform(lo, hi)


class FaultApp:
    def __init__(self, config: dict | None = None):
        self.config = dict(DEFAULTS)
        self.config.update(config or {})
        self.rng = random.Random(self.config["seed"])
        self.reset()

    def reset(self) -> None:
        """Zero the counters and restart the fault draws from ``config["seed"]`` (a test's faults do not depend
        on the tests before it)."""
        self.rng = random.Random(self.config["seed"])
        self.requests = 0
        self.outcomes: dict[str, int] = {}
        self.completed = 0
        self.completed_by_body: dict[str, int] = {}
        self.in_flight = 0
        self.max_in_flight = 0
        self.connections = 0
        self.bodies: list[dict] = []
        self.headers: list[dict] = []
        self.costs: dict[str, float] = {}
        self.cost_lookups: dict[str, int] = {}

    def record(self, body: dict, headers: dict) -> None:
        keep = int(self.config.get("record_bodies") or 0)
        if keep:
            self.bodies = (self.bodies + [body])[-keep:]
            h = {k: ("present" if k == "authorization" else v) for k, v in headers.items()}
            self.headers = (self.headers + [h])[-keep:]

    def native(self, body: dict, bh: str) -> dict:
        """SGLang ``/generate`` reply (see module docstring)."""
        c = self.config
        rnd = random.Random(bh)
        vocab = list(c["gen_vocab"])
        ids: list[int] = []
        if c["gen_think"]:
            o, cl = c["gen_think"]  # o null: the prompt already opened the think block (Kimi K2.5, thinking on)
            ids += ([] if o is None else [o]) + rnd.choices(vocab, k=int(c["reasoning_tokens"])) + [cl]
        ids += rnd.choices(vocab, k=rnd.randint(int(c["min_tokens"]), int(c["max_tokens"])))
        stop = None
        if c["gen_eot"] is not None:
            stop = int(c["gen_eot"])
            ids.append(stop)
        cap = (body.get("sampling_params") or {}).get("max_new_tokens", 128)
        if len(ids) > int(cap):
            ids, finish = ids[:int(cap)], {"type": "length", "length": int(cap)}
        else:
            finish = {"type": "stop", "matched": stop}
            if stop is not None and not c["gen_include_stop"]:
                ids = ids[:-1]
        text = "".join(chr(i) for i in ids if i < 256)
        n_in = len(body.get("input_ids") or [])
        return {"text": text, "output_ids": ids, "meta_info": {
            "id": bh, "finish_reason": finish, "prompt_tokens": n_in, "completion_tokens": len(ids),
            "cached_tokens": 0, "e2e_latency": 0.0}}

    def stats(self) -> dict:
        return {
            "requests": self.requests, "outcomes": dict(self.outcomes), "completed": self.completed,
            "completed_by_body": dict(self.completed_by_body), "in_flight": self.in_flight,
            "max_in_flight": self.max_in_flight, "cpu_s": round(time.process_time(), 3),
            "connections": self.connections,
        }

    def _count(self, what: str) -> None:
        self.outcomes[what] = self.outcomes.get(what, 0) + 1

    def pick_fault(self) -> str | None:
        c = self.config
        if c["fail_after"] is not None and self.requests > int(c["fail_after"]):
            return "fail_status"
        r = self.rng.random()
        for name in ("p429", "p5xx", "ptimeout", "preset", "perror200", "pmalformed", "p402", "psurrogate",
                     "pbadusage"):
            r -= float(c[name])
            if r < 0:
                return name
        return None

    def latency(self, bh: str) -> float:
        """Seconds to wait before answering: see :func:`latency_of` (drawn from the shared rng unless
        ``latency_by_body``, which makes it a function of the request body, so a benchmark can compute the
        ideal schedule)."""
        return latency_of(self.config, bh if self.config["latency_by_body"] else None, self.rng)

    def completion(self, body: dict, bh: str) -> dict:
        c = self.config
        rnd = random.Random(bh)
        n = rnd.randint(int(c["min_tokens"]), int(c["max_tokens"]))
        finish = "stop"
        cap = body.get("max_tokens")
        if cap is not None and n > int(cap):
            n, finish = int(cap), "length"
        text = " ".join(rnd.choices(WORDS, k=n))
        nr = int(c["reasoning_tokens"])
        reasoning = " ".join(rnd.choices(WORDS, k=nr)) if nr else None
        return chat_completion(c, body, bh, text, reasoning, finish, completion_tokens=n + nr, reasoning_tokens=nr)


def chat_completion(c: dict, body: dict, bh: str, text: str, reasoning: str | None, finish: str, *,
                    completion_tokens: int, reasoning_tokens: int) -> dict:
    """An OpenRouter-style ``chat.completion`` reply for request ``body`` (hash ``bh``) under config ``c``: the
    prompt's word count as ``prompt_tokens``, a ``cost`` from ``price_in``/``price_out``, the reasoning (if any)
    under ``reasoning_field``. Shared with ``benchmarks/rehearsal_server.py``."""
    prompt_words = sum(len(str(m.get("content") or "").split()) for m in body.get("messages") or [])
    msg = {"role": "assistant", "content": text}
    if reasoning is not None:
        msg[c["reasoning_field"]] = reasoning
    comp = completion_tokens
    return {
        "id": f"gen-{bh}", "object": "chat.completion", "created": int(time.time()),
        "model": c["model"] or body.get("model"), "provider": c["provider"],
        "choices": [{"index": 0, "finish_reason": finish, "native_finish_reason": finish, "message": msg}],
        "usage": {
            "prompt_tokens": prompt_words, "completion_tokens": comp, "total_tokens": prompt_words + comp,
            "completion_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "cost": round(prompt_words * c["price_in"] + comp * c["price_out"], 12),
        },
    }


def _response(status: int, payload, headers: dict | None = None) -> bytes:
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    reason = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 402: "Payment Required", 404: "Not Found",
              429: "Too Many Requests", 500: "Internal Server Error", 502: "Bad Gateway",
              503: "Service Unavailable"}.get(status, "Status")
    head = [f"HTTP/1.1 {status} {reason}", "Content-Type: application/json", f"Content-Length: {len(body)}"]
    for k, v in (headers or {}).items():
        head.append(f"{k}: {v}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class _Reset(Exception):
    pass


async def _handle(app: FaultApp, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    app.connections += 1
    try:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            lines = head.decode("latin-1").split("\r\n")
            method, path, _ = (lines[0].split(" ", 2) + ["", ""])[:3]
            headers = {}
            for ln in lines[1:]:
                if ":" in ln:
                    k, v = ln.split(":", 1)
                    headers[k.strip().lower()] = v.strip()
            n = int(headers.get("content-length") or 0)
            raw = await reader.readexactly(n) if n else b""
            try:
                out = await _route(app, method, path, headers, raw)
            except _Reset:
                sock = writer.get_extra_info("socket")
                if sock is not None:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                writer.transport.abort()
                return
            if out is None:  # hang ended: close without answering
                writer.close()
                return
            writer.write(out)
            await writer.drain()
            if headers.get("connection", "").lower() == "close":
                writer.close()
                return
    except (ConnectionError, asyncio.IncompleteReadError):
        return
    except asyncio.CancelledError:  # server shutting down (don't re-raise: 3.11 logs cancelled callbacks)
        writer.transport.abort()
        return


async def _route(app: FaultApp, method: str, path: str, headers: dict, raw: bytes) -> bytes | None:
    full_path = path
    path = path.split("?", 1)[0]
    if method == "GET" and path == "/health":
        return _response(200, {"status": "ok"})
    if method == "GET" and path == "/stats":
        return _response(200, app.stats())
    if method == "POST" and path == "/admin/config":
        app.config.update(json.loads(raw or b"{}"))
        return _response(200, app.config)
    if method == "POST" and path == "/admin/reset":
        app.reset()
        return _response(200, {"ok": True})
    if method == "GET" and path == "/admin/bodies":
        return _response(200, {"bodies": app.bodies, "headers": app.headers})
    if method == "GET" and path in ("/v1/generation", "/api/v1/generation"):
        from urllib.parse import parse_qs, urlsplit

        gid = (parse_qs(urlsplit(full_path).query).get("id") or [""])[0]
        n = app.cost_lookups[gid] = app.cost_lookups.get(gid, 0) + 1
        if gid not in app.costs or n <= int(app.config["cost_404s"]):
            return _response(404, {"error": {"code": 404, "message": f"Generation {gid} not found"}})
        return _response(200, {"data": {"id": gid, "total_cost": app.costs[gid], "provider_name":
                                        app.config["provider"]}})
    if method == "GET" and path == "/v1/models":
        # OpenRouter's model list carries per-token prices (USD, decimal strings): the forecast reads them
        return _response(200, {"object": "list", "data": [{"id": app.config["model"] or "fault-model", "pricing": {
            "prompt": str(app.config["price_in"]), "completion": str(app.config["price_out"])}}]})
    native = path == "/generate"
    if method != "POST" or path not in ("/v1/chat/completions", "/chat/completions", "/generate"):
        return _response(404, {"error": {"code": 404, "message": f"no route {method} {path}"}})
    c = app.config
    app.requests += 1
    if c["require_key"] and headers.get("authorization") != f"Bearer {c['require_key']}":
        app._count("401")
        return _response(401, {"error": {"code": 401, "message": "No auth credentials found"}})
    try:
        body = json.loads(raw)
    except ValueError:
        app._count("400")
        return _response(400, {"error": {"code": 400, "message": "invalid JSON body"}})
    app.record(body, headers)
    if c["require_tool_reasoning"] and not native:
        bad = [i for i, m in enumerate(body.get("messages") or []) if isinstance(m, dict)
               and m.get("role") == "assistant" and m.get("tool_calls") and m.get("reasoning_content") is None]
        if bad:
            app._count("400")
            return _response(400, {"error": {"code": 400, "message": "thinking is enabled but reasoning_content is "
                                             f"missing in assistant tool call message at index {bad[0]}"}})
    fault = app.pick_fault()
    app.in_flight += 1
    app.max_in_flight = max(app.max_in_flight, app.in_flight)
    try:
        bh = body_hash(body)
        lat = app.latency(bh)
        if fault == "ptimeout":
            app._count("timeout")
            await asyncio.sleep(float(c["hang_s"]))
            return None
        if lat > 0:
            await asyncio.sleep(lat)
        if fault == "p429":
            app._count("429")
            return _response(429, {"error": {"code": 429, "message": "Rate limit exceeded"}},
                             {"Retry-After": str(c["retry_after_s"])})
        if fault == "p5xx":
            code = app.rng.choice([500, 502, 503])
            app._count(str(code))
            return _response(code, {"error": {"code": code, "message": "provider error"}})
        if fault == "preset":
            app._count("reset")
            raise _Reset()
        if fault == "perror200":
            app._count("error200")
            return _response(200, {"id": "gen-err", "provider": c["provider"], "choices": [
                {"index": 0, "finish_reason": "error", "message": {"role": "assistant", "content": ""},
                 "error": {"code": 502, "message": "upstream provider error mid-generation"}}]})
        if fault == "pmalformed":
            app._count("malformed")
            return _response(200, b'{"id": "gen-x", "choices": [{"message": {"content": "trunc')
        if fault == "psurrogate":  # a reply whose text can't be stored (the client must retry it)
            app._count("surrogate")
            resp = app.completion(body, bh)
            resp["choices"][0]["message"]["content"] += " \ud800"
            return _response(200, resp)
        if fault in ("p402", "fail_status"):
            code = int(c["fail_status"]) if fault == "fail_status" else 402
            app._count(str(code))
            return _response(code, (fault == "fail_status" and c["fail_body"]) or
                             {"error": {"code": code, "message": "Insufficient credits"}})
        if native:
            if app.rng.random() < float(c["gen_abort_rate"]):
                app._count("abort")
                return _response(200, {"text": "", "output_ids": [], "meta_info": {
                    "id": bh, "finish_reason": {"type": "abort", "message": "scheduler aborted the request"}}})
            resp = app.native(body, bh)
        else:
            resp = app.completion(body, bh)
            app.costs[resp["id"]] = resp["usage"]["cost"]
            if c["omit_cost"]:
                del resp["usage"]["cost"]
            if fault == "pbadusage":  # values no column can hold: the client stores nulls, keeps the reply
                app._count("badusage")
                resp["usage"].update({"cost": float("nan"), "prompt_tokens": 1e30, "completion_tokens_details":
                                      {"reasoning_tokens": -3}})
                resp["choices"][0]["token_ids"] = [1, 2**40]
        app._count("ok")
        app.completed += 1
        app.completed_by_body[bh] = app.completed_by_body.get(bh, 0) + 1
        return _response(200, resp)
    finally:
        app.in_flight -= 1


class FaultServer:
    """Run :class:`FaultApp` on 127.0.0.1 in a background thread (tests). ``url`` is ``http://127.0.0.1:P``."""

    def __init__(self, config: dict | None = None, port: int = 0):
        self.app = FaultApp(config)
        self.port = port
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "FaultServer":
        ready = threading.Event()

        def run():
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)

            async def main():
                self._server = await asyncio.start_server(
                    lambda r, w: _handle(self.app, r, w), "127.0.0.1", self.port, backlog=4096, limit=2**24)
                self.port = self._server.sockets[0].getsockname()[1]
                ready.set()

            self._loop.run_until_complete(main())
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("fault server did not start")
        return self

    def configure(self, **cfg) -> None:
        self._loop.call_soon_threadsafe(self.app.config.update, cfg)

    def stats(self) -> dict:
        return self.app.stats()

    def stop(self) -> None:
        if self._loop is None:
            return

        async def shutdown():
            self._server.close()
            for t in asyncio.all_tasks():
                if t is not asyncio.current_task():
                    t.cancel()

        fut = asyncio.run_coroutine_threadsafe(shutdown(), self._loop)
        fut.result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def __enter__(self) -> "FaultServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--config", default="{}", help="JSON object of settings (see module docstring)")
    ap.add_argument("--startup-delay", type=float, default=0.0, help="seconds before listening (launcher tests)")
    ap.add_argument("--fail-startup", action="store_true", help="exit with code 3 instead of serving")
    args = ap.parse_args(argv)
    if args.host not in ("127.0.0.1", "localhost"):
        raise SystemExit("fault server listens on loopback only")
    print(f"fault server starting on {args.host}:{args.port}", flush=True)
    if args.fail_startup:
        print("simulated startup failure", flush=True)
        raise SystemExit(3)
    time.sleep(args.startup_delay)
    serve_forever(FaultApp(json.loads(args.config)), args.host, args.port, "fault server")


def serve_forever(app: FaultApp, host: str, port: int, name: str) -> None:
    """Serve ``app`` on ``host:port`` until interrupted (the standalone entry points use this)."""

    async def serve():
        server = await asyncio.start_server(lambda r, w: _handle(app, r, w), host, port, backlog=8192, limit=2**24)
        print(f"{name} listening on {host}:{port}", flush=True)
        async with server:
            await server.serve_forever()

    try:
        asyncio.run(serve())
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
