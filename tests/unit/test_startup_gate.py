"""The machine's start-up gate for generate jobs (eagle3_data.generate.startup): at most ``slots`` processes hold it at once,
a dead holder's slot comes back, and a job waits at most ``max_wait_s``."""

import subprocess
import sys
import textwrap
import time

from eagle3_data.generate import startup

HOLD = textwrap.dedent("""
    import sys, time
    from eagle3_data.generate import startup
    ok = startup.acquire(2, directory=sys.argv[1], max_wait_s=float(sys.argv[2]))
    print("held" if ok else "ungated", flush=True)
    time.sleep(float(sys.argv[3]))
""")


def _holder(tmp_path, wait_s, hold_s):
    return subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path), str(wait_s), str(hold_s)], stdout=subprocess.PIPE, text=True
    )


def test_two_slots_hold_two_jobs_and_a_third_waits_for_a_dead_holder(tmp_path):
    a, b = _holder(tmp_path, 5, 60), _holder(tmp_path, 5, 60)
    assert a.stdout.readline().strip() == "held" and b.stdout.readline().strip() == "held"
    try:
        # both slots taken: this process waits, then goes on ungated
        t0 = time.monotonic()
        assert startup.acquire(2, directory=tmp_path, max_wait_s=0.3) is False
        assert 0.25 <= time.monotonic() - t0 < 3
        assert not startup.held()
        a.kill()  # kill -9 of a holder: the kernel drops its lock
        a.wait()
        assert startup.acquire(2, directory=tmp_path, max_wait_s=5) is True
        assert startup.held()
        assert startup.acquire(2, directory=tmp_path, max_wait_s=0) is True  # already held: no second slot
        startup.release()
        assert not startup.held()
        startup.release()  # idempotent
    finally:
        for p in (a, b):
            p.kill()
            p.wait()


def test_a_released_slot_lets_the_next_job_start(tmp_path):
    assert startup.acquire(1, directory=tmp_path, max_wait_s=0)
    c = _holder(tmp_path.parent / tmp_path.name, 5, 0)  # 2 slots there, 1 taken by this process
    assert c.stdout.readline().strip() == "held"
    c.wait()
    startup.release()
    d = subprocess.run(
        [sys.executable, "-c", HOLD.replace("acquire(2", "acquire(1"), str(tmp_path), "0", "0"],
        capture_output=True,
        text=True,
    )
    assert d.stdout.strip() == "held"


def test_an_unwritable_gate_never_blocks(tmp_path):
    f = tmp_path / "file"
    f.write_text("")
    assert startup.acquire(2, directory=f, max_wait_s=5) is False  # startup/ under a file: cannot be made
    assert not startup.held()
