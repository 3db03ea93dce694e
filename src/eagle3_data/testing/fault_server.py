"""A fault-injecting OpenAI/OpenRouter-compatible chat-completions server for tests and benchmarks.

A Starlette application (routes: :meth:`FaultApp.routes`) served by uvicorn, both installed with
``transformers[serving]``; keep-alive connections stay open. Our own code is left only for what ASGI can't do:
resetting a connection or closing it without a reply (``preset``, ``ptimeout``: :func:`_drop`). Measured with
``benchmarks/generation_client.py`` (10,000 requests, 2,000 in flight, ~1,500-word replies, 2-core machine; the
three clients' runs): uvicorn (its pure-Python h11 protocol: httptools is not installed) takes 0.71-0.82 ms of
server CPU per request (7.1-8.2 s), where the hand-written asyncio server it replaced took 0.27-0.35 ms
(2.7-3.5 s); both kept all 2,000 requests in flight and the client's wall time stayed within 5 % of the
zero-overhead schedule (1.041 vs 1.030). It keeps up, at about 0.1 of a core at the benchmark's ~145 requests/s.
Endpoints:

- ``POST /v1/chat/completions``: a deterministic reply (text derived from a hash of the request body), with
  faults drawn at the configured rates: ``p429`` (with ``Retry-After``), ``p5xx`` (500/502/503), ``ptimeout``
  (hangs ``hang_s`` then closes), ``preset`` (TCP reset), ``perror200`` (200 with ``choices[0].error`` +
  ``finish_reason: "error"``; its code ``error200_code``, default 502), ``pmalformed`` (200 with a truncated JSON
  body), ``p402``, ``psurrogate`` (200
  whose content ends in an unpaired ``\\ud800``), ``pbadusage`` (200 with a NaN cost, a 1e30 prompt count, a
  negative reasoning count and an out-of-range token id; counted as completed), ``pbadbytes`` (a paid 200 reply,
  valid JSON, whose content holds the bytes ``\\xff\\xfe``, not UTF-8; counted as completed), ``perror422body``
  (200 whose body is ``{"error": {"code": 422, ...}}``), ``pnotjson`` (200 whose body is ``notjson_body``, an HTML
  error page by default, ``""`` for an empty body: nothing generated, nothing billed); ``pad_bytes`` (every reply's
  content padded with that many bytes, its billed tokens unchanged); ``echo_key`` (every reply quotes the request's
  Bearer token: in its content, or in the top-level field ``echo_key_field``, e.g. ``system_fingerprint``); ``fail_after``
  (every request after that many gets HTTP ``fail_status``, e.g. 402, with body ``fail_body`` when set);
  ``storm_s`` (a 429 storm: every request arriving within that many seconds of the first one since the last reset
  gets HTTP 429 with ``Retry-After``, at once);
  ``require_key`` (401 unless the
  Bearer token matches). ``fault_at`` (fault name -> ``"end"``, ``"start"`` or ``"uniform"``; default ``"end"``
  for each): when a drawn fault answers, after the request's whole latency (``end``), at once (``start``: a
  rate limit refuses before generating) or at a uniformly drawn point of it (``uniform``: a provider failing
  mid-generation). Latency: uniform in ``[latency_min_s, latency_max_s]``. Reply length: uniform in
  ``[min_tokens, max_tokens]`` words, capped by the request's ``max_tokens`` (then ``finish_reason:
  "length"``). ``usage`` has prompt/completion/reasoning tokens and ``cost`` (``price_in``/``price_out`` per
  token); ``provider`` is set (OpenRouter style); ``reasoning_field`` picks ``reasoning`` (OpenRouter) or
  ``reasoning_content`` (SGLang) for a short reasoning text (``reasoning_tokens`` words; 0 = none).
  ``omit_cost`` leaves ``usage.cost`` out (the client may then look it up by generation id); ``omit_usage``
  leaves the whole ``usage`` out (a server that reports neither tokens nor cost).
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
  ``billed_by_body`` (the same, cut-off ``pmalformed`` replies included: a provider bills them too),
  ``billed_completion_tokens`` / ``billed_usd`` (usage of the ok chat replies sent: what a client's budget
  counts), ``in_flight``, ``max_in_flight``, ``cpu_s`` (the server process's CPU seconds),
  ``connections`` (TCP connections that sent a request), ``last_request_at`` (unix time the last chat/generate
  request arrived; every arrival in ``FaultApp.request_times``).
- ``POST /admin/config`` (JSON: keys above), ``POST /admin/reset`` (zero counters).

Run: ``python -m eagle3_data.testing.fault_server --port 8000 [--config '{"p429": 0.1}'] [--startup-delay 1]``, or in a
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
    "p429": 0.0,
    "p5xx": 0.0,
    "ptimeout": 0.0,
    "preset": 0.0,
    "perror200": 0.0,
    "pmalformed": 0.0,
    "p402": 0.0,
    "psurrogate": 0.0,
    "pbadusage": 0.0,
    "pbadbytes": 0.0,
    "perror422body": 0.0,
    "pnotjson": 0.0,
    "notjson_body": "<html><body><h1>502 Bad Gateway</h1></body></html>",
    "pad_bytes": 0,
    "echo_key": False,
    "echo_key_field": "content",
    "retry_after_s": 0.05,
    "hang_s": 30.0,
    "fail_after": None,
    "fail_status": 402,
    "fail_body": None,
    "require_key": None,
    "latency_min_s": 0.0,
    "latency_max_s": 0.0,
    "min_tokens": 5,
    "max_tokens": 40,
    "price_in": 1e-7,
    "price_out": 2e-6,
    "provider": "FaultProvider",
    "reasoning_field": "reasoning",
    "reasoning_tokens": 0,
    "seed": 0,
    "model": None,
    "latency_dist": "uniform",
    "latency_by_body": False,
    "record_bodies": 50,
    "omit_cost": False,
    "omit_usage": False,
    "cost_404s": 0,
    "gen_vocab": list(range(97, 123)) + [32],
    "gen_think": None,
    "gen_eot": None,
    "gen_include_stop": True,
    "gen_abort_rate": 0.0,
    "require_tool_reasoning": False,
    "fault_at": {},
    "storm_s": 0.0,
    "error200_code": 502,
}

WORDS = (
    "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau "
    "upsilon phi chi psi omega"
).split()


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
        self.billed_by_body: dict[str, int] = {}  # 200 replies a provider bills (ok ones and cut-off ones)
        self.billed_completion_tokens = 0  # usage.completion_tokens of the ok chat replies sent (what a budget counts)
        self.billed_usd = 0.0  # their usage.cost
        self.fail_times: list[float] = []  # time.time() each fail_after answer was sent
        self.in_flight = 0
        self.max_in_flight = 0
        self.connections = 0
        self.clients: set[tuple] = set()  # (host, port) of the connections that sent a request
        self.bodies: list[dict] = []
        self.headers: list[dict] = []
        self.costs: dict[str, float] = {}
        self.cost_lookups: dict[str, int] = {}
        self.request_times: list[float] = []  # time.time() each chat/generate request arrived

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
            ids, finish = ids[: int(cap)], {"type": "length", "length": int(cap)}
        else:
            finish = {"type": "stop", "matched": stop}
            if stop is not None and not c["gen_include_stop"]:
                ids = ids[:-1]
        text = "".join(chr(i) for i in ids if i < 256)
        n_in = len(body.get("input_ids") or [])
        return {
            "text": text,
            "output_ids": ids,
            "meta_info": {
                "id": bh,
                "finish_reason": finish,
                "prompt_tokens": n_in,
                "completion_tokens": len(ids),
                "cached_tokens": 0,
                "e2e_latency": 0.0,
            },
        }

    def stats(self) -> dict:
        return {
            "requests": self.requests,
            "outcomes": dict(self.outcomes),
            "completed": self.completed,
            "completed_by_body": dict(self.completed_by_body),
            "billed_by_body": dict(self.billed_by_body),
            "billed_completion_tokens": self.billed_completion_tokens,
            "billed_usd": self.billed_usd,
            "in_flight": self.in_flight,
            "max_in_flight": self.max_in_flight,
            "cpu_s": round(time.process_time(), 3),
            "connections": self.connections,
            "last_request_at": self.request_times[-1] if self.request_times else None,
        }

    def _count(self, what: str) -> None:
        self.outcomes[what] = self.outcomes.get(what, 0) + 1

    def pick_fault(self) -> str | None:
        c = self.config
        if c["fail_after"] is not None and self.requests > int(c["fail_after"]):
            return "fail_status"
        if c["storm_s"] and self.request_times and self.request_times[-1] - self.request_times[0] < float(c["storm_s"]):
            return "storm"
        r = self.rng.random()
        for name in (
            "p429",
            "p5xx",
            "ptimeout",
            "preset",
            "perror200",
            "pmalformed",
            "p402",
            "psurrogate",
            "pbadusage",
            "pbadbytes",
            "perror422body",
            "pnotjson",
        ):
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

    # --- HTTP: Starlette routes (served by uvicorn; see make_asgi) ---

    def routes(self) -> list:
        """The Starlette routes serving this app. A subclass adds its own in front
        (``eagle3_data.testing.rehearsal_server``) or overrides an endpoint method (:meth:`chat`); the last route answers every other
        method and path with a JSON 404."""
        from starlette.routing import Route

        return [
            Route("/health", self.health, methods=["GET"]),
            Route("/stats", self.stats_endpoint, methods=["GET"]),
            Route("/admin/config", self.admin_config, methods=["POST"]),
            Route("/admin/reset", self.admin_reset, methods=["POST"]),
            Route("/admin/bodies", self.admin_bodies, methods=["GET"]),
            Route("/v1/generation", self.generation, methods=["GET"]),
            Route("/api/v1/generation", self.generation, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/chat/completions", self.chat, methods=["POST"]),
            Route("/generate", self.chat, methods=["POST"]),
            Route("/{path:path}", self.no_route, methods=_ALL_METHODS),
        ]

    async def health(self, request):
        return json_response(200, {"status": "ok"})

    async def stats_endpoint(self, request):
        return json_response(200, self.stats())

    async def admin_config(self, request):
        self.config.update(json.loads(await request.body() or b"{}"))
        return json_response(200, self.config)

    async def admin_reset(self, request):
        self.reset()
        return json_response(200, {"ok": True})

    async def admin_bodies(self, request):
        return json_response(200, {"bodies": self.bodies, "headers": self.headers})

    async def generation(self, request):
        """OpenRouter's cost lookup by generation id."""
        gid = request.query_params.get("id", "")
        n = self.cost_lookups[gid] = self.cost_lookups.get(gid, 0) + 1
        if gid not in self.costs or n <= int(self.config["cost_404s"]):
            return json_response(404, {"error": {"code": 404, "message": f"Generation {gid} not found"}})
        return json_response(
            200, {"data": {"id": gid, "total_cost": self.costs[gid], "provider_name": self.config["provider"]}}
        )

    async def models(self, request):
        # OpenRouter's model list carries per-token prices (USD, decimal strings): the forecast reads them
        return json_response(
            200,
            {
                "object": "list",
                "data": [
                    {
                        "id": self.config["model"] or "fault-model",
                        "pricing": {
                            "prompt": str(self.config["price_in"]),
                            "completion": str(self.config["price_out"]),
                        },
                    }
                ],
            },
        )

    async def no_route(self, request):
        return json_response(404, {"error": {"code": 404, "message": f"no route {request.method} {request.url.path}"}})

    async def chat(self, request):
        """``POST /v1/chat/completions``, ``/chat/completions`` (OpenAI) and ``/generate`` (SGLang native), with
        the configured faults (module docstring)."""
        try:
            return await self._chat(request)
        except asyncio.CancelledError:  # the server stopping while the request runs: drop it, quietly
            transport = _transport(request)
            if transport is not None:
                transport.abort()
            return json_response(499, {"error": "server stopped"})

    async def _chat(self, request):
        raw = await request.body()
        headers = dict(request.headers)  # lower-case names
        native = request.url.path == "/generate"
        c = self.config
        self.requests += 1
        self.request_times.append(time.time())
        if c["require_key"] and headers.get("authorization") != f"Bearer {c['require_key']}":
            self._count("401")
            return json_response(401, {"error": {"code": 401, "message": "No auth credentials found"}})
        try:
            body = json.loads(raw)
        except ValueError:
            self._count("400")
            return json_response(400, {"error": {"code": 400, "message": "invalid JSON body"}})
        self.record(body, headers)
        if c["require_tool_reasoning"] and not native:
            bad = [
                i
                for i, m in enumerate(body.get("messages") or [])
                if isinstance(m, dict)
                and m.get("role") == "assistant"
                and m.get("tool_calls")
                and m.get("reasoning_content") is None
            ]
            if bad:
                self._count("400")
                return json_response(
                    400,
                    {
                        "error": {
                            "code": 400,
                            "message": "thinking is enabled but reasoning_content "
                            f"is missing in assistant tool call message at index {bad[0]}",
                        }
                    },
                )
        fault = self.pick_fault()
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            bh = body_hash(body)
            lat = self.latency(bh)
            if fault == "ptimeout":
                self._count("timeout")
                await asyncio.sleep(float(c["hang_s"]))
                return await _drop(request, reset=False)  # close without answering
            if fault is not None:
                at = (c["fault_at"] or {}).get(fault, "end")
                lat *= 0.0 if at == "start" else self.rng.random() if at == "uniform" else 1.0
            if lat > 0:
                await asyncio.sleep(lat)
            if fault == "storm":  # a rate-limit storm refuses at once, before generating
                self._count("429")
                return json_response(
                    429,
                    {"error": {"code": 429, "message": "Rate limit exceeded"}},
                    {"Retry-After": str(c["retry_after_s"])},
                )
            if fault == "p429":
                self._count("429")
                return json_response(
                    429,
                    {"error": {"code": 429, "message": "Rate limit exceeded"}},
                    {"Retry-After": str(c["retry_after_s"])},
                )
            if fault == "p5xx":
                code = self.rng.choice([500, 502, 503])
                self._count(str(code))
                return json_response(code, {"error": {"code": code, "message": "provider error"}})
            if fault == "preset":
                self._count("reset")
                return await _drop(request, reset=True)
            if fault == "perror200":
                self._count("error200")
                return json_response(
                    200,
                    {
                        "id": "gen-err",
                        "provider": c["provider"],
                        "choices": [
                            {
                                "index": 0,
                                "finish_reason": "error",
                                "message": {"role": "assistant", "content": ""},
                                "error": {
                                    "code": int(c["error200_code"]),
                                    "message": "upstream provider error mid-generation",
                                },
                            }
                        ],
                    },
                )
            if fault == "pmalformed":  # billed like any generated reply, whatever reached the client
                self._count("malformed")
                self.billed_by_body[bh] = self.billed_by_body.get(bh, 0) + 1
                return json_response(200, b'{"id": "gen-x", "choices": [{"message": {"content": "trunc')
            if fault == "psurrogate":  # a billed reply whose text can't be stored (journaled once, never re-bought)
                self._count("surrogate")
                self.billed_by_body[bh] = self.billed_by_body.get(bh, 0) + 1
                resp = self.completion(body, bh)
                resp["choices"][0]["message"]["content"] += " \ud800"
                return json_response(200, resp)
            if fault == "pnotjson":  # a proxy's error page (or an empty body) with status 200: nothing generated
                self._count("notjson")
                return json_response(200, str(c["notjson_body"]).encode())
            if fault == "perror422body":  # a client error in a 200 body: no retry can fix it
                self._count("error422body")
                return json_response(
                    200,
                    {"error": {"code": 422, "message": "Unprocessable: max_tokens exceeds the model's context length"}},
                )
            if fault in ("p402", "fail_status"):
                code = int(c["fail_status"]) if fault == "fail_status" else 402
                self._count(str(code))
                self.fail_times.append(time.time())
                return json_response(
                    code,
                    (fault == "fail_status" and c["fail_body"])
                    or {"error": {"code": code, "message": "Insufficient credits"}},
                )
            if native:
                if self.rng.random() < float(c["gen_abort_rate"]):
                    self._count("abort")
                    return json_response(
                        200,
                        {
                            "text": "",
                            "output_ids": [],
                            "meta_info": {
                                "id": bh,
                                "finish_reason": {"type": "abort", "message": "scheduler aborted the request"},
                            },
                        },
                    )
                resp = self.native(body, bh)
            else:
                resp = self.completion(body, bh)
                self.costs[resp["id"]] = resp["usage"]["cost"]
                self.billed_completion_tokens += int(resp["usage"]["completion_tokens"])
                self.billed_usd += float(resp["usage"]["cost"])
                if c["omit_cost"]:
                    del resp["usage"]["cost"]
                if c["omit_usage"]:  # a server reporting no usage at all (tokens nor cost)
                    del resp["usage"]
                if fault == "pbadusage":  # values no column can hold: the client stores nulls, keeps the reply
                    self._count("badusage")
                    resp["usage"].update(
                        {
                            "cost": float("nan"),
                            "prompt_tokens": 1e30,
                            "completion_tokens_details": {"reasoning_tokens": -3},
                        }
                    )
                    resp["choices"][0]["token_ids"] = [1, 2**40]
                if c["echo_key"]:  # a reply quoting the request's API key (a prompt injection, a debug echo)
                    token = (headers.get("authorization") or "").removeprefix("Bearer ")
                    if c["echo_key_field"] == "content":
                        resp["choices"][0]["message"]["content"] += f" my key is {token}."
                    else:  # any other top-level field of the reply (system_fingerprint, a provider's own field)
                        resp[str(c["echo_key_field"])] = f"fp-{token}"
                if c["pad_bytes"]:  # a reply far larger than its billed tokens
                    resp["choices"][0]["message"]["content"] += " " + "x" * int(c["pad_bytes"])
            self._count("ok")
            self.completed += 1
            self.completed_by_body[bh] = self.completed_by_body.get(bh, 0) + 1
            self.billed_by_body[bh] = self.billed_by_body.get(bh, 0) + 1
            if fault == "pbadbytes" and not native:  # valid JSON holding bytes that are not UTF-8 (paid for)
                self._count("badbytes")
                resp["choices"][0]["message"]["content"] += " BADBYTES"
                return json_response(200, json.dumps(resp).encode().replace(b"BADBYTES", b"\xff\xfe"))
            return json_response(200, resp)
        finally:
            self.in_flight -= 1


def chat_completion(
    c: dict,
    body: dict,
    bh: str,
    text: str,
    reasoning: str | None,
    finish: str,
    *,
    completion_tokens: int,
    reasoning_tokens: int,
) -> dict:
    """An OpenRouter-style ``chat.completion`` reply for request ``body`` (hash ``bh``) under config ``c``: the
    prompt's word count as ``prompt_tokens``, a ``cost`` from ``price_in``/``price_out``, the reasoning (if any)
    under ``reasoning_field``. Shared with ``eagle3_data.testing.rehearsal_server``."""
    prompt_words = sum(len(str(m.get("content") or "").split()) for m in body.get("messages") or [])
    msg = {"role": "assistant", "content": text}
    if reasoning is not None:
        msg[c["reasoning_field"]] = reasoning
    comp = completion_tokens
    return {
        "id": f"gen-{bh}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": c["model"] or body.get("model"),
        "provider": c["provider"],
        "choices": [{"index": 0, "finish_reason": finish, "native_finish_reason": finish, "message": msg}],
        "usage": {
            "prompt_tokens": prompt_words,
            "completion_tokens": comp,
            "total_tokens": prompt_words + comp,
            "completion_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "cost": round(prompt_words * c["price_in"] + comp * c["price_out"], 12),
        },
    }


def json_response(status: int, payload, headers: dict | None = None):
    """A JSON reply (``payload``: an object, or bytes sent as they are, e.g. a truncated body)."""
    from starlette.responses import Response

    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return Response(body, status_code=status, headers=headers, media_type="application/json")


# Our own code, kept because the library can't do it: ASGI has no message that resets a connection (RST) or
# closes it without a reply, which ``preset`` and ``ptimeout`` need (a Starlette endpoint can only return a
# response, and uvicorn answers an exception with a 500: ``run_asgi`` in its h11/httptools protocols). These reach
# the connection's asyncio transport through uvicorn's per-request cycle (``request.receive`` is its bound method,
# holding ``.transport``, in both protocols); ``tests/workflow/test_generate.py`` injects both faults and checks the client
# retries them.
def _transport(request):
    """The asyncio transport of ``request``'s connection (None when not served by uvicorn)."""
    return getattr(getattr(request.receive, "__self__", None), "transport", None)


async def _drop(request, reset: bool):
    """Drop ``request``'s connection: a TCP reset (``SO_LINGER`` 0, then abort) or a plain close. Returns a
    placeholder response, which uvicorn does not send (the connection is gone)."""
    transport = _transport(request)
    if transport is None:  # not under uvicorn: answer 500 rather than pretend
        raise RuntimeError("fault server: no transport to drop")
    sock = transport.get_extra_info("socket")
    if reset and sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort() if reset else transport.close()
    await asyncio.sleep(0)  # uvicorn sees the connection lost and sends nothing more on it
    return json_response(499, {"error": "connection dropped"})


_ALL_METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]


def make_asgi(app: FaultApp):
    """The ASGI application serving ``app``: Starlette routing over ``app.routes()``, and the ``connections``
    counter (TCP connections that sent a request since the last reset, told apart by client port)."""
    from starlette.applications import Starlette

    star = Starlette(routes=app.routes())

    async def asgi(scope, receive, send):
        client = scope.get("client")
        if client is not None:
            client = tuple(client)
            if client not in app.clients:
                app.clients.add(client)
                app.connections += 1
        await star(scope, receive, send)

    return asgi


def _uvicorn_config(app: FaultApp, host: str, port: int):
    import uvicorn

    # keep-alive connections stay open (a client's pooled connection is never closed under it between requests,
    # which a test would see as a reset); a backlog for thousands of connections at once; on SIGINT/SIGTERM the
    # requests still running get 1 s, then are cancelled (FaultServer.stop forces the exit: cancelled at once)
    return uvicorn.Config(
        make_asgi(app),
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        lifespan="off",
        backlog=8192,
        timeout_keep_alive=3600,
        timeout_graceful_shutdown=1,
    )


class FaultServer:
    """Run :class:`FaultApp` on 127.0.0.1 with uvicorn in a background thread (tests). ``url`` is
    ``http://127.0.0.1:P``. ``stop()`` cancels the requests still running (hangs included) at once."""

    def __init__(self, config: dict | None = None, port: int = 0):
        self.app = FaultApp(config)
        self.port = port
        self._server = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "FaultServer":
        import uvicorn

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port))
        self.port = sock.getsockname()[1]
        self._server = uvicorn.Server(_uvicorn_config(self.app, "127.0.0.1", self.port))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("fault server did not start")
            time.sleep(0.01)
        return self

    def configure(self, **cfg) -> None:
        self.app.config.update(cfg)

    def stats(self) -> dict:
        return self.app.stats()

    def stop(self) -> None:
        if self._server is None:
            return
        self._server.should_exit = self._server.force_exit = True  # no wait: the loop's end cancels what runs
        self._thread.join(10)
        self._server = None

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
    import uvicorn

    server = uvicorn.Server(_uvicorn_config(app, host, port))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(8192)  # connections queue from here on; uvicorn serves them once started
    print(f"{name} listening on {host}:{port}", flush=True)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
