"""vLLM's exact ids (``return_token_ids``, vLLM >= 0.10.2): the request flag, the completion's ``token_ids`` kept as
exact ids, the server's ``prompt_token_ids`` kept and checked against the target's render (early stop in generate,
a ``server_prompt_mismatch`` reject at tokenize).

A fake vLLM: the fault server (eagle3_data.testing.fault_server) whose chat replies carry ``prompt_token_ids`` (the tiny
target's real render, or a wrong one) and ``choices[0].token_ids`` (the content's real ids, + ``<|im_end|>`` unless cut at max_tokens)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from test_generate import backends_cfg, gen_cfg, run, simple_convs, write_prompts

from eagle3_data.backends import BackendConfig, build_body
from eagle3_data.generate import GenerationStopped
from eagle3_data.prompt_check import EARLY_REPLIES

KW = {"thinking": False}  # the tiny (Kimi K2.5-like) target without thinking: completion C<|im_end|>


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from eagle3_data.settings import TinyTargetSettings
    from eagle3_data.templates import load_target_tokens
    from eagle3_data.tiny_target import build_tiny_target

    path = tmp_path_factory.mktemp("target") / "tiny"
    build_tiny_target(path, settings=TinyTargetSettings.defaults(seed=0))
    return path, load_target_tokens(str(path), "kimi-k25", chat_template_kwargs=KW)


def vllm_like(fs, tt, wrong_after: int | None):
    """Make ``fs`` answer as vLLM does with return_token_ids; prompts of the ``wrong_after``-th sample on (by the
    number in 'question number N') get a server render with one token changed (a system prompt's worth of
    template difference, at a known position)."""
    orig = fs.app.completion

    def completion(body, bh):
        resp = orig(body, bh)
        msgs = body["messages"]
        ids = tt.encode_texts([tt.render(msgs, None, True)])[0]
        n = int(str(msgs[-1]["content"]).split()[-1])
        if wrong_after is not None and n >= wrong_after:
            ids = list(ids)
            ids[3] = (ids[3] + 1) % 200
        text = resp["choices"][0]["message"]["content"]
        resp["prompt_token_ids"] = ids
        if body.get("return_token_ids"):
            stop = resp["choices"][0]["finish_reason"] == "stop"  # a cut reply has no end-of-turn id
            resp["choices"][0]["token_ids"] = tt.encode_texts([text])[0] + [tt.eot_id] * stop
        else:
            resp.pop("prompt_token_ids")
        return resp

    fs.app.completion = completion
    return orig


def vllm_backend(fs, **kw):
    return backends_cfg(fs, name="vllm", type="openai", model="local/tiny", return_token_ids=True, **kw)


def target_of(path):
    return {"path": str(path), "template": "kimi-k25", "chat_template_kwargs": KW}


def test_body_carries_return_token_ids_only_when_on():
    off = BackendConfig.from_dict("v", {"type": "openai", "base_url": "http://127.0.0.1:1/v1", "model": "m"})
    on = BackendConfig.from_dict(
        "v", {"type": "openai", "base_url": "http://127.0.0.1:1/v1", "model": "m", "return_token_ids": True}
    )
    msgs = [{"role": "user", "content": "hi"}]
    a, b = build_body(off, msgs, None, {"max_tokens": 5}), build_body(on, msgs, None, {"max_tokens": 5})
    assert "return_token_ids" not in a and b.pop("return_token_ids") is True and a == b
    with pytest.raises(ValueError, match="return_token_ids is a vLLM option"):
        BackendConfig.from_dict(
            "v", {"type": "openrouter", "base_url": "http://x/v1", "model": "m", "return_token_ids": True}
        )


def test_matching_render_exact_ids_and_prompt_ids_kept(tmp_path, fs, tiny):
    from eagle3_data.tokens import tokenize_rows

    path, tt = tiny
    orig = vllm_like(fs, tt, None)
    try:
        prompts = write_prompts(tmp_path / "p.parquet", simple_convs(12))
        s = run(tmp_path, fs, prompts, gen=gen_cfg(backends=["vllm"]), bk=vllm_backend(fs), target=target_of(path))
    finally:
        fs.app.completion = orig
    assert s["ok"] == 12 and all(b["return_token_ids"] is True for b in fs.app.bodies)
    rows = pq.read_table(tmp_path / "out.parquet").to_pylist()
    toks = tokenize_rows(rows, tt)
    assert [t["ids_source"] for t in toks] == ["exact"] * 12 and not any(t["reject_reason"] for t in toks)
    for r, t in zip(rows, toks):
        ours = tt.encode_texts([tt.render(json.loads(r["messages"]), None, True)])[0]
        assert r["prompt_ids"] == ours and t["input_ids"] == ours + r["output_ids"]
        assert [x for x, m in zip(t["input_ids"], t["loss_mask"]) if m] == r["output_ids"]


def test_early_mismatch_stops_the_job_naming_position_and_tokens(tmp_path, fs, tiny):
    path, tt = tiny
    orig = vllm_like(fs, tt, 0)
    try:
        prompts = write_prompts(tmp_path / "p.parquet", simple_convs(200))
        with pytest.raises(GenerationStopped) as ei:
            run(
                tmp_path,
                fs,
                prompts,
                gen=gen_cfg(backends=["vllm"]),
                bk=vllm_backend(fs, max_concurrency=2),
                target=target_of(path),
            )
    finally:
        fs.app.completion = orig
    msg = str(ei.value)
    ours = tt.encode_texts([tt.render(simple_convs(1)[0][:1], None, True)])[0]
    tok = tt.decode_batch([[ours[3]]])[0]
    assert "at token 3" in msg and repr(tok) in msg and "target.template" in msg
    assert len(fs.app.bodies) <= 4  # 2 in flight at most besides the first: not 200 paid


def test_late_mismatch_is_a_tokenize_reject(tmp_path, fs, tiny):
    from eagle3_data.tokens import tokenize_rows

    path, tt = tiny
    orig = vllm_like(fs, tt, 30)  # samples 30..39 rendered otherwise by the "server": after the early check
    try:
        prompts = write_prompts(tmp_path / "p.parquet", simple_convs(40))
        s = run(
            tmp_path,
            fs,
            prompts,
            gen=gen_cfg(backends=["vllm"]),
            bk=vllm_backend(fs, max_concurrency=1),
            target=target_of(path),
        )
    finally:
        fs.app.completion = orig
    assert s["ok"] == 40 and EARLY_REPLIES < 30
    toks = tokenize_rows(pq.read_table(tmp_path / "out.parquet").to_pylist(), tt)
    reasons = [t["reject_reason"] for t in toks]
    assert reasons.count("server_prompt_mismatch") == 10 and reasons.count(None) == 30
    bad = next(t for t in toks if t["reject_reason"])
    assert "at token 3" in bad["reject_detail"] and bad["input_ids"] == []


# ------------------------------------------------------------------------------------------ a launched vLLM server

FAKE_VLLM = '''#!{python}
"""A stand-in for vLLM's CLI: `vllm serve MODEL --host H --port P ...`; /health answers 200 once "loaded"."""
import http.server, json, sys, time
args = sys.argv[1:]
assert args[0] == "serve", args
host, port = args[args.index("--host") + 1], int(args[args.index("--port") + 1])
open(sys.argv[0] + ".argv", "w").write(json.dumps(args))
time.sleep(0.5)  # loading the model: /health is not up yet


class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *a):
        pass


http.server.HTTPServer((host, port), H).serve_forever()
'''


def fake_vllm_env(tmp_path) -> Path:
    env = tmp_path / ".venv-vllm"
    (env / "bin").mkdir(parents=True)
    (env / "bin" / "python").symlink_to(sys.executable)
    prog = env / "bin" / "vllm"
    prog.write_text(FAKE_VLLM.replace("{python}", sys.executable))
    prog.chmod(0o755)
    return env


def test_launched_vllm_command_line_and_ready_check(tmp_path):
    from eagle3_data.backends.server import launch_server

    env = fake_vllm_env(tmp_path)
    launch = {
        "command": "vllm serve {model} --host 127.0.0.1 --port {port} --tensor-parallel-size 1",
        "python": str(env),
        "ready_path": "/health",
        "ready_timeout_s": 30,
    }
    with launch_server(launch, "org/model", tmp_path / "server.log", name="vllm") as srv:
        assert srv.command[0] == str(env / "bin" / "vllm")
        assert srv.command[1:] == [
            "serve",
            "org/model",
            "--host",
            "127.0.0.1",
            "--port",
            str(srv.port),
            "--tensor-parallel-size",
            "1",
        ]
        import httpx

        assert httpx.get(f"http://127.0.0.1:{srv.port}/health", trust_env=False).status_code == 200
        argv = json.loads((env / "bin" / "vllm.argv").read_text())
        assert argv[:2] == ["serve", "org/model"]
    assert not srv.alive()


def test_launched_vllm_without_host_is_refused(tmp_path):
    from eagle3_data.backends.server import launch_server

    env = fake_vllm_env(tmp_path)
    launch = {"command": "vllm serve {model} --port {port}", "python": str(env)}
    with pytest.raises(ValueError, match="vLLM listens on every interface.*--host 127.0.0.1"):
        with launch_server(launch, "org/model", tmp_path / "server.log", name="vllm"):
            pass
