"""Local server launcher: start on a free loopback port, wait for readiness, always stop (process group)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from eagle3_data.backends.server import ServerLaunchError, launch_server, server_env

FAULT = f"{sys.executable} -m eagle3_data.testing.fault_server --port {{port}}"


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
    assert f"listening on 127.0.0.1:{srv.port}" in log.read_text()  # output went to the log file


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
    script.write_text(
        textwrap.dedent("""
        import os, sys, http.server
        print("MODEL=" + sys.argv[1], "FLAG=" + os.environ.get("E3D_FLAG", ""), flush=True)
        http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[2])), http.server.SimpleHTTPRequestHandler).serve_forever()
    """)
    )
    launch = {"command": f"{sys.executable} {script} {{model}} {{port}}", "ready_path": "/", "env": {"E3D_FLAG": "on"}}
    with launch_server(launch, "my/model", tmp_path / "s.log") as srv:
        assert srv.command[-2:] == ["my/model", str(srv.port)]
    text = (tmp_path / "s.log").read_text()
    assert "MODEL=my/model" in text and "FLAG=on" in text


def test_thread_count_zero_from_a_threadless_job_is_not_passed_to_the_server():
    # the generate rule has threads: 0, so Snakemake runs its script with OMP_NUM_THREADS=0 (and the like), which
    # libgomp rejects; the server gets its library default, while a real count and launch.env are kept
    base = {"PATH": "/bin", "OMP_NUM_THREADS": "0", "MKL_NUM_THREADS": "0", "OPENBLAS_NUM_THREADS": "3"}
    env = server_env({}, base)
    assert "OMP_NUM_THREADS" not in env and "MKL_NUM_THREADS" not in env
    assert env["OPENBLAS_NUM_THREADS"] == "3" and env["PATH"] == "/bin"
    assert server_env({"env": {"OMP_NUM_THREADS": 4}}, base)["OMP_NUM_THREADS"] == "4"
    assert base["OMP_NUM_THREADS"] == "0"  # the job's own environment is not changed


JOB = textwrap.dedent("""
    import json, sys
    from eagle3_data.errors import run_stage
    from eagle3_data.generate import generate
    from eagle3_data.settings import GenerateSettings
    settings = GenerateSettings.defaults(target_name="t", generation={gen!r}, backends={backends!r},
                                         journal_dir={journal!r})
    run_stage(lambda: generate({prompts!r}, {out!r}, settings, shard="000", log={log!r}))
""")


def _job(tmp_path, n=30, latency=5.0):
    from test_generate import simple_convs, write_prompts

    prompts = write_prompts(tmp_path / "p.parquet", simple_convs(n))
    cfg = json.dumps({"latency_min_s": latency, "latency_max_s": latency})
    backends = {
        "local": dict(
            type="openai",
            base_url="http://127.0.0.1:{port}/v1",
            model="m",
            api_key_env=None,
            max_concurrency=4,
            timeout_s=60,
            launch={"command": FAULT + f" --config '{cfg}'", "ready_path": "/health"},
        )
    }
    gen = dict(backends=["local"], mode="last", max_tokens=20, temperature=1.0, top_p=1.0, extra_body={}, max_retries=1)
    code = JOB.format(
        prompts=str(prompts),
        out=str(tmp_path / "out.parquet"),
        gen=gen,
        backends=backends,
        journal=str(tmp_path / "journal"),
        log=str(tmp_path / "logs" / "job.log"),
    )
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
        time.sleep(1.5)  # server ready, requests in flight
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
    from eagle3_data.settings import GenerateSettings

    code, backends, gen, prompts = _job(tmp_path, n=6, latency=0.0)
    settings = GenerateSettings.defaults(
        target_name="t", generation=gen, backends=backends, journal_dir=tmp_path / "journal"
    )
    kw = dict(shard="000", log=tmp_path / "logs" / "job.log")
    s1 = generate(prompts, tmp_path / "a.parquet", settings, **kw)
    assert s1["servers_started"] == ["local"] and s1["ok"] == 6 and s1["sent"] == 6
    size = (tmp_path / "logs" / "job.server-local.log").stat().st_size
    s2 = generate(prompts, tmp_path / "b.parquet", settings, **kw)
    assert s2["servers_started"] == [] and s2["sent"] == 0 and s2["ok"] == 6
    assert (tmp_path / "logs" / "job.server-local.log").stat().st_size == size


# ---------------------------------------------------------------------------------------------------------------
# the server's own environment and GPUs

ENV_SERVER = textwrap.dedent("""
    import os, sys, http.server
    print("EXE=" + sys.executable, "PATH0=" + os.environ["PATH"].split(os.pathsep)[0],
          "CONDA_PREFIX=" + os.environ.get("CONDA_PREFIX", ""),
          "CVD=" + os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>"), flush=True)
    http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), http.server.SimpleHTTPRequestHandler).serve_forever()
""")


def fake_env(tmp_path: Path) -> Path:
    """A conda-style environment directory whose bin/python is this interpreter (a symlink)."""
    env = tmp_path / "gpu-env"
    (env / "bin").mkdir(parents=True)
    (env / "conda-meta").mkdir()
    (env / "bin" / "python").symlink_to(sys.executable)
    return env


def test_launch_runs_in_its_own_environment(tmp_path):
    env = fake_env(tmp_path)
    script = tmp_path / "srv.py"
    script.write_text(ENV_SERVER)
    launch = {"command": f"python {script} {{port}}", "ready_path": "/", "python": str(env)}
    with launch_server(launch, "m", tmp_path / "s.log") as srv:
        assert srv.command[0] == str(env / "bin" / "python")  # `python` is the environment's interpreter
    text = (tmp_path / "s.log").read_text()
    assert f"EXE={env / 'bin' / 'python'}" in text and f"PATH0={env / 'bin'}" in text and f"CONDA_PREFIX={env}" in text
    with pytest.raises(ServerLaunchError, match=r"launch.python: /nonexistent/env does not exist") as ei:
        with launch_server({**launch, "python": "/nonexistent/env"}, "m", tmp_path / "s2.log"):
            pass
    assert "docs/environments.md" in str(ei.value)


def fake_gpus(monkeypatch, tmp_path: Path, n: int) -> None:
    """A machine of ``n`` GPUs for the per-GPU lock pool (locks under ``tmp_path/locks``), none visible yet."""
    monkeypatch.setenv("EAGLE3_NUM_GPUS", str(n))
    monkeypatch.setenv("EAGLE3_GPU_LOCK_DIR", str(tmp_path / "locks"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def _devices(log: Path) -> list[str]:
    for line in log.read_text().splitlines():
        if "CVD=" in line:
            return line.split("CVD=")[1].split()[0].split(",")
    raise AssertionError(f"no CVD line in {log}")


def test_launched_servers_and_extraction_get_distinct_gpus(tmp_path, monkeypatch):
    """Devices through the per-GPU lock pool (the one extraction uses): two workflow-scoped servers of 2 GPUs each
    on a 4-GPU machine get disjoint devices, an extraction job finds none free while they run, all after they stop."""
    from eagle3_data.backends.server import shared_server, stop_run_servers
    from eagle3_data.devices import gpu_devices
    from eagle3_data.runtime.run import Owner, Run

    fake_gpus(monkeypatch, tmp_path, 4)
    script = tmp_path / "srv.py"
    script.write_text(ENV_SERVER)
    run = Run(tmp_path / "run", Owner.me())
    launch = {"command": f"python {script} {{port}}", "ready_path": "/", "gpus": 2}
    with (
        shared_server(launch, "m", name="a", run=run, log_path=tmp_path / "a.log") as a,
        shared_server(launch, "m2", name="b", run=run, log_path=tmp_path / "b.log") as b,
    ):
        da, db = _devices(tmp_path / "a.log"), _devices(tmp_path / "b.log")
        assert sorted(da) == sorted(a.devices) and sorted(db) == sorted(b.devices)
        assert len(da) == len(db) == 2 and sorted(da + db) == ["0", "1", "2", "3"]
        with pytest.raises(TimeoutError):
            with gpu_devices(1, timeout_s=1.0, set_env=False):
                pass
    assert sorted(stop_run_servers(run.dir)) == ["a", "b"]
    with gpu_devices(4, timeout_s=10.0, set_env=False) as devs:
        assert devs == ["0", "1", "2", "3"]


# ---------------------------------------------------------------------------------------------------------------
# one server per run

ATTACH = textwrap.dedent("""
    import json, sys
    from eagle3_data.backends.server import shared_server
    from eagle3_data.runtime.run import Owner, Run
    a = json.loads(sys.argv[1])
    run = Run(__import__("pathlib").Path(a["run"]), Owner.parse(a["owner"]))
    with shared_server(a["launch"], "m", name="local", run=run, log_path=a["log"]) as srv:
        print(json.dumps({"port": srv.port, "started": srv.started, "pid": srv.pid}), flush=True)
        sys.stdin.readline()   # hold the lease until told
""")


def _attach(tmp_path, launch, owner):
    arg = json.dumps(
        {
            "run": str(tmp_path / "run"),
            "owner": str(owner),
            "launch": launch,
            "log": str(tmp_path / "logs" / "local.log"),
        }
    )
    return subprocess.Popen(
        [sys.executable, "-c", ATTACH, arg], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )


def test_concurrent_jobs_attach_to_one_server_which_the_run_end_stops(tmp_path):
    from eagle3_data.backends.server import stop_run_servers
    from eagle3_data.runtime.run import Owner

    launch = {"command": FAULT + " --startup-delay 1.5", "ready_path": "/health", "ready_timeout_s": 60}
    jobs = [_attach(tmp_path, launch, Owner.me()) for _ in range(4)]
    try:
        seen = [json.loads(j.stdout.readline()) for j in jobs]
        assert len({s["port"] for s in seen}) == 1 and sum(s["started"] for s in seen) == 1
        log = (tmp_path / "logs" / "local.log").read_text()
        assert log.count("fault server listening on") == 1  # one start for four jobs
        sup = seen[0]["pid"]
        server = int(re.search(r"ready in [0-9.]+ s on port \d+ \(pid (\d+)\)", log).group(1))
        for j in jobs:
            j.stdin.write("\n")
            j.stdin.flush()
            assert j.wait(30) == 0
        assert not gone(server, within=1.0)  # no lease: still up (idle timeout)
        assert stop_run_servers(tmp_path / "run") == ["local"]
        assert gone(server, within=0.5) and gone(sup, within=0.5)
        entries = [p for p in (tmp_path / "run" / "servers").glob("*.json") if not p.name.endswith(".spec.json")]
        assert entries == []  # the registry entry is gone
    finally:
        for j in jobs:
            j.kill()


def test_server_stops_when_the_run_owner_dies_or_idles(tmp_path):
    from eagle3_data.backends.server import shared_server
    from eagle3_data.runtime.run import Owner, Run, process_start

    owner_proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        owner = Owner(Owner.me().host, owner_proc.pid, process_start(owner_proc.pid))
        run = Run(tmp_path / "run", owner)
        with shared_server({"command": FAULT}, "m", name="local", run=run, log_path=tmp_path / "l.log") as srv:
            entry = json.loads(
                next(
                    p for p in (tmp_path / "run" / "servers").glob("*.json") if not p.name.endswith(".spec.json")
                ).read_text()
            )
            owner_proc.kill()  # the snakemake process is killed (SIGKILL)
            assert gone(entry["server_pid"], within=5.0) and gone(srv.pid, within=5.0)
        assert "the workflow run ended (its snakemake process is gone)" in (tmp_path / "l.log").read_text()
    finally:
        owner_proc.kill()
    run = Run(tmp_path / "run2", Owner.me())
    launch = {"command": FAULT, "idle_timeout_s": 1}
    with shared_server(launch, "m", name="local", run=run, log_path=tmp_path / "i.log") as first:
        pass
    assert gone(first.pid, within=8.0)  # no job for 1 s: stopped
    assert "no job used it for 1 s" in (tmp_path / "i.log").read_text()
    with shared_server(launch, "m", name="local", run=run, log_path=tmp_path / "i.log") as again:
        assert again.started and again.pid != first.pid  # the next job starts it again
    assert gone(again.pid, within=8.0)


def test_shared_server_that_fails_to_start_says_why(tmp_path):
    from eagle3_data.backends.server import shared_server
    from eagle3_data.runtime.run import Owner, Run

    run = Run(tmp_path / "run", Owner.me())
    with pytest.raises(ServerLaunchError, match="exited with code 3 before it was ready") as ei:
        with shared_server(
            {"command": FAULT + " --fail-startup"}, "m", name="local", run=run, log_path=tmp_path / "l.log"
        ):
            pass
    assert "simulated startup failure" in str(ei.value)
    out = subprocess.run(["pgrep", "-f", "fail-startup"], capture_output=True, text=True).stdout.split()
    assert [p for p in out if int(p) != os.getpid()] == []


SLOW_STOP_SERVER = textwrap.dedent("""
    import os, signal, sys, threading, time, http.server
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), http.server.SimpleHTTPRequestHandler)
    def on_term(*_):  # a server that takes its time to shut down (SGLang freeing its GPUs)
        def later():
            time.sleep(float(sys.argv[2]))
            os._exit(0)
        threading.Thread(target=later).start()
    signal.signal(signal.SIGTERM, on_term)
    print("CVD=" + os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>"), flush=True)
    srv.serve_forever()
""")


def test_an_idle_server_keeps_its_gpus_until_it_is_gone_and_no_job_attaches_while_it_stops(tmp_path, monkeypatch):
    """The idle stop of a GPU server: its device locks are held until the server process has exited (an
    extraction job waiting on them would otherwise start on GPUs whose memory the server still holds), and a job
    that comes while it stops waits for it to be gone and starts a new one instead of attaching to it."""
    from eagle3_data.backends.server import shared_server, stop_run_servers
    from eagle3_data.devices import gpu_devices
    from eagle3_data.runtime.run import Owner, Run

    fake_gpus(monkeypatch, tmp_path, 2)
    script = tmp_path / "slow.py"
    script.write_text(SLOW_STOP_SERVER)
    run = Run(tmp_path / "run", Owner.me())
    launch = {
        "command": f"python {script} {{port}} 3",
        "ready_path": "/",
        "gpus": 2,
        "idle_timeout_s": 1,
        "stop_grace_s": 10,
    }
    with shared_server(launch, "m", name="gpu", run=run, log_path=tmp_path / "g.log") as first:
        entry_path = next(p for p in (tmp_path / "run" / "servers").glob("*.json") if not p.name.endswith(".spec.json"))
        server_pid = json.loads(entry_path.read_text())["server_pid"]
    deadline = time.monotonic() + 15
    while json.loads(entry_path.read_text()).get("state") != "stopping":  # idle for 1 s: the stop begins
        assert time.monotonic() < deadline, "the idle server was not stopped"
        time.sleep(0.05)
    assert not gone(server_pid, within=1.0)  # the server takes 3 s to go...
    with pytest.raises(TimeoutError):  # ...and keeps its GPUs meanwhile
        with gpu_devices(1, timeout_s=0.5, set_env=False):
            pass
    t0 = time.monotonic()
    with shared_server(launch, "m", name="gpu", run=run, log_path=tmp_path / "g.log") as again:
        assert gone(server_pid, within=0.1), "a job attached to (or started beside) a server being stopped"
        assert again.started and again.pid != first.pid and time.monotonic() - t0 > 1.0
    assert stop_run_servers(run.dir) == ["gpu"]
    with gpu_devices(2, timeout_s=10.0, set_env=False) as devs:  # all free once both are gone
        assert devs == ["0", "1"]
