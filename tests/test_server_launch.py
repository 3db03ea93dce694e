"""Local server launcher: start on a free loopback port, wait for readiness, always stop (process group)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from eagle3_data.backends.server import ServerLaunchError, launch_server

HERE = Path(__file__).parent
FAULT = f"{sys.executable} {HERE / 'fault_server.py'} --port {{port}}"


def gone(pid: int, within: float = 10.0) -> bool:
    t = time.monotonic()
    while time.monotonic() - t < within:
        try:
            os.kill(pid, 0)
            with open(f"/proc/{pid}/stat") as fh:  # a zombie counts as gone
                if fh.read().split(") ")[1].startswith("Z"):
                    return True
        except (ProcessLookupError, FileNotFoundError):
            return True
        time.sleep(0.05)
    return False


def test_start_ready_stop(tmp_path):
    log = tmp_path / "server.log"
    with launch_server({"command": FAULT, "ready_path": "/health", "ready_timeout_s": 30}, "m", log) as srv:
        pid = srv.pid
        r = httpx.get(f"http://127.0.0.1:{srv.port}/health")
        assert r.status_code == 200
        assert srv.alive()
    assert gone(pid)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{srv.port}/health")
    assert f"listening on 127.0.0.1:{srv.port}" in log.read_text()      # output went to the log file


def test_stopped_on_exception(tmp_path):
    with pytest.raises(RuntimeError, match="boom"):
        with launch_server({"command": FAULT}, "m", tmp_path / "s.log") as srv:
            pid = srv.pid
            raise RuntimeError("boom")
    assert gone(pid)


def test_early_exit_reports_log_tail(tmp_path):
    with pytest.raises(ServerLaunchError, match="simulated startup failure") as ei:
        with launch_server({"command": FAULT + " --fail-startup"}, "m", tmp_path / "s.log"):
            pass
    assert "exited with code 3" in str(ei.value)


def test_ready_timeout_kills_process(tmp_path):
    t = time.monotonic()
    with pytest.raises(ServerLaunchError, match="not ready"):
        with launch_server({"command": FAULT + " --startup-delay 30", "ready_timeout_s": 1}, "m", tmp_path / "s.log"):
            pass
    assert time.monotonic() - t < 15
    out = subprocess.run(["pgrep", "-f", "startup-delay 30"], capture_output=True, text=True).stdout.split()
    assert [p for p in out if int(p) != os.getpid()] == []


def test_refuses_non_loopback_host(tmp_path):
    with pytest.raises(ValueError, match="127.0.0.1"):
        with launch_server({"command": "python -m x --host 0.0.0.0 --port {port}"}, "m", tmp_path / "s.log"):
            pass


def test_placeholders_and_env(tmp_path):
    script = tmp_path / "echo_server.py"
    script.write_text(textwrap.dedent("""
        import os, sys, http.server
        print("MODEL=" + sys.argv[1], "FLAG=" + os.environ.get("E3D_FLAG", ""), flush=True)
        http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[2])), http.server.SimpleHTTPRequestHandler).serve_forever()
    """))
    launch = {"command": f"{sys.executable} {script} {{model}} {{port}}", "ready_path": "/", "env": {"E3D_FLAG": "on"}}
    with launch_server(launch, "my/model", tmp_path / "s.log") as srv:
        assert srv.command[-2:] == ["my/model", str(srv.port)]
    text = (tmp_path / "s.log").read_text()
    assert "MODEL=my/model" in text and "FLAG=on" in text


JOB = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {tests!r})
    from eagle3_data.generate import generate
    generate({prompts!r}, {out!r}, dataset="ds", shard="000", target_name="t", generation={gen!r},
             backends={backends!r}, journal_dir={journal!r}, log={log!r})
""")


def _job(tmp_path, n=30, latency=5.0):
    from test_generate import simple_convs, write_prompts

    prompts = write_prompts(tmp_path / "p.parquet", simple_convs(n))
    cfg = json.dumps({"latency_min_s": latency, "latency_max_s": latency})
    backends = {"local": dict(type="openai", base_url="http://127.0.0.1:{port}/v1", model="m", api_key_env=None,
                              max_concurrency=4, timeout_s=60,
                              launch={"command": FAULT + f" --config '{cfg}'", "ready_path": "/health"})}
    gen = dict(backends=["local"], mode="last", max_tokens=20, temperature=1.0, top_p=1.0, extra_body={}, max_retries=1)
    code = JOB.format(tests=str(HERE), prompts=str(prompts), out=str(tmp_path / "out.parquet"), gen=gen,
                      backends=backends, journal=str(tmp_path / "journal"), log=str(tmp_path / "logs" / "job.log"))
    return code, backends, gen, prompts


def _children(pid: int) -> list[int]:
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []


def _wait_child(proc) -> int:
    t = time.monotonic()
    while time.monotonic() - t < 30:
        kids = _children(proc.pid)
        if kids:
            return kids[0]
        time.sleep(0.1)
    raise AssertionError("job started no server")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_server_stopped_when_job_is_killed(tmp_path, sig):
    code, *_ = _job(tmp_path)
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=tmp_path)
    try:
        child = _wait_child(proc)
        time.sleep(1.5)                                         # server ready, requests in flight
        proc.send_signal(sig)
        proc.wait(30)
        assert gone(child), "local server outlived its job"
    finally:
        if proc.poll() is None:
            proc.kill()
    if sig == signal.SIGTERM:
        assert "interrupted" in (tmp_path / "logs" / "job.log").read_text()
    assert (tmp_path / "logs" / "job.server-local.log").exists()


def test_generate_starts_server_only_when_needed(tmp_path):
    from eagle3_data.generate import generate

    code, backends, gen, prompts = _job(tmp_path, n=6, latency=0.0)
    kw = dict(dataset="ds", shard="000", target_name="t", generation=gen, backends=backends,
              journal_dir=tmp_path / "journal", log=tmp_path / "logs" / "job.log")
    s1 = generate(prompts, tmp_path / "a.parquet", **kw)
    assert s1["servers_started"] == ["local"] and s1["ok"] == 6 and s1["sent"] == 6
    size = (tmp_path / "logs" / "job.server-local.log").stat().st_size
    s2 = generate(prompts, tmp_path / "b.parquet", **kw)
    assert s2["servers_started"] == [] and s2["sent"] == 0 and s2["ok"] == 6
    assert (tmp_path / "logs" / "job.server-local.log").stat().st_size == size
