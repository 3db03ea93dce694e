"""The rehearsal's stand-in for OpenRouter / SGLang: ``eagle3_data.testing.fault_server`` with per-dataset reply profiles.

A thin subclass of :class:`eagle3_data.testing.fault_server.FaultApp` (the fault server itself is unchanged and owned elsewhere), so
the rehearsal gets the fault server's HTTP handling, fault injection (429 with Retry-After, 5xx, errors inside
a 200 body) and ``/stats``, plus what a full-scale rehearsal needs:

- **profiles**: ``profile_field`` names a top-level request field (the rehearsal config sets
  ``generation.extra_body.user`` = the dataset name, the OpenAI/OpenRouter ``user`` field) whose value selects
  ``profiles[value]``, a dict of config overrides for that request (lengths, latency, prices, provider);
  ``model_profiles[model]`` does the same by the request's ``model`` (one per backend: its stream speed), under
  the dataset's profile;
- **exact-length ASCII replies**: the reply ``content`` is exactly ``n`` characters of ASCII text (words,
  punctuation, newlines; no leading/trailing whitespace) and ``usage.completion_tokens = n + eot_tokens``, so a
  byte-level tokenizer (1 char = 1 token, ``eagle3_data.tiny_target``) reconstructs exactly the billed count
  once the end-of-turn token is appended;
- **length distributions**: ``length_dist`` ``lognormal`` with mean ``length_mean`` (characters) and log-sd
  ``length_sigma``, clipped to ``[min_tokens, max_tokens]`` (else the fault server's uniform), drawn from a hash
  of the request body (a retry of the same request gets the same reply);
- **latency proportional to length**: ``latency_min_s..latency_max_s`` (uniform, from the body hash) plus
  ``n * latency_per_token_s``, so long replies arrive last (as long SWE-agent trajectories do);
- **request intervals**: ``GET /admin/intervals`` lists ``[model, arrival, reply, first]`` per chat request, from
  which the rehearsal computes the requests in flight per backend over the run.

Run standalone: ``python -m eagle3_data.testing.rehearsal_server --port P --config '{json}'`` (loopback only).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time

from eagle3_data.testing import fault_server as fs

EXTRA_DEFAULTS = {
    "profile_field": None,
    "profiles": {},
    "length_dist": "uniform",
    "length_mean": None,
    "length_sigma": 0.8,
    "eot_tokens": 0,
    "latency_per_token_s": 0.0,
    "model_profiles": {},
}

_CORPUS_WORDS = (
    "the a of to in is for on with that this it as be by are from at or an not we can if you will def return "
    "import class self value result data list index error file path test function method object string number "
    "array count check update build parse print output input config server client request response model token "
    "shard merge batch loss mask layer hidden state target draft reasoning completion prompt format schema"
).split()


def _corpus(size: int = 1 << 20, seed: int = 1234) -> str:
    """Deterministic ASCII text (words, punctuation, newlines) of ``size`` characters."""
    rnd = random.Random(seed)
    parts, n = [], 0
    while n < size:
        words = rnd.choices(_CORPUS_WORDS, k=rnd.randint(4, 18))
        s = " ".join(words).capitalize() + rnd.choice([". ", ". ", ", ", "; ", ":\n", ".\n\n", "? "])
        parts.append(s)
        n += len(s)
    return "".join(parts)[:size]


CORPUS = _corpus()


def ascii_text(rnd: random.Random, n: int) -> str:
    """Exactly ``n`` ASCII characters of text, neither starting nor ending with whitespace (n >= 1)."""
    if n <= 0:
        return ""
    reps = n // len(CORPUS) + 2
    off = rnd.randrange(len(CORPUS))
    src = CORPUS if reps <= 2 and off + n <= len(CORPUS) else CORPUS * reps
    t = src[off : off + n]
    if t[0].isspace():
        t = "A" + t[1:]
    if t[-1].isspace():
        t = t[:-1] + "."
    return t


class RehearsalApp(fs.FaultApp):
    """FaultApp with per-request profiles, exact-length ASCII replies and length-proportional latency."""

    def __init__(self, config: dict | None = None):
        cfg = dict(EXTRA_DEFAULTS)
        cfg.update(config or {})
        super().__init__(cfg)
        self._notes: dict[str, tuple] = {}  # body hash -> (profile name, model) (set before latency is drawn)
        self.intervals: list[list] = []  # [model, arrival, reply, first attempt of its body] per chat request
        self.seen: set[str] = set()

    def profile_of(self, body: dict) -> str | None:
        field = self.config.get("profile_field")
        v = body.get(field) if field else None
        return str(v) if v is not None else None

    def cfg_for(self, profile: str | None, model: str | None = None) -> dict:
        over = (self.config.get("profiles") or {}).get(profile) if profile is not None else None
        by_model = (self.config.get("model_profiles") or {}).get(model) if model is not None else None
        return {**self.config, **(by_model or {}), **(over or {})} if over or by_model else self.config

    def note(self, body: dict) -> None:
        self._notes[fs.body_hash(body)] = (self.profile_of(body), str(body.get("model")))

    def length(self, c: dict, bh: str) -> int:
        rnd = random.Random("len:" + bh)
        lo, hi = int(c["min_tokens"]), int(c["max_tokens"])
        if c.get("length_dist") == "lognormal" and c.get("length_mean"):
            s = float(c["length_sigma"])
            mu = math.log(float(c["length_mean"])) - s * s / 2
            return int(min(hi, max(lo, round(rnd.lognormvariate(mu, s)))))
        return rnd.randint(lo, hi)

    def latency(self, bh: str) -> float:
        c = self.cfg_for(*self._notes.get(bh, (None, None)))
        base = random.Random("lat:" + bh).uniform(float(c["latency_min_s"]), float(c["latency_max_s"]))
        per = float(c.get("latency_per_token_s") or 0.0)
        return base + (self.length(c, bh) * per if per else 0.0)

    def completion(self, body: dict, bh: str) -> dict:
        self._notes.pop(bh, None)
        c = self.cfg_for(self.profile_of(body), str(body.get("model")))
        n = self.length(c, bh)
        eot = int(c.get("eot_tokens") or 0)
        finish = "stop"
        cap = body.get("max_tokens")
        if cap is not None and n + eot > int(cap):
            n, eot, finish = int(cap), 0, "length"
        text = ascii_text(random.Random("txt:" + bh), n)
        nr = int(c["reasoning_tokens"])
        reasoning = ascii_text(random.Random("rsn:" + bh), nr) if nr else None
        return fs.chat_completion(
            c, body, bh, text, reasoning, finish, completion_tokens=n + nr + eot, reasoning_tokens=nr
        )

    def routes(self) -> list:
        from starlette.routing import Route

        return [Route("/admin/intervals", self.admin_intervals, methods=["GET"])] + super().routes()

    async def admin_intervals(self, request):
        return fs.json_response(200, {"intervals": self.intervals})

    async def chat(self, request):
        """Note each chat request's profile before the fault server draws its latency, then delegate; record each
        chat request's ``[model, arrival, reply, first]`` (monotonic seconds; ``first``: its body was not seen
        before) for ``GET /admin/intervals`` (requests in flight per backend over time)."""
        if not request.url.path.endswith("/chat/completions"):
            return await super().chat(request)
        model, first = None, False
        try:
            body = json.loads(await request.body())
            if isinstance(body, dict):
                self.note(body)
                model = str(body.get("model"))
                bh = fs.body_hash(body)
                first = bh not in self.seen
                self.seen.add(bh)
        except ValueError:
            pass
        t0 = time.monotonic()
        try:
            return await super().chat(request)
        finally:
            self.intervals.append([model, round(t0, 4), round(time.monotonic(), 4), first])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--config", default="{}", help="JSON object: fault_server settings + the keys above")
    args = ap.parse_args(argv)
    fs.serve_forever(RehearsalApp(json.loads(args.config)), "127.0.0.1", args.port, "rehearsal server")


if __name__ == "__main__":
    main()
