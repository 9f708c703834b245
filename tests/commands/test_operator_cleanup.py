"""Nothing is left behind: children die with their parent (even by kill -9), a producer with
worker processes removes its temporary directory on SIGTERM and SIGINT, a failed
`feedline lmdb build` leaves no output, and Ctrl-C in the demo is one line and stops all it
started. Real processes, real signals, bounded waits."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

from feedline.procs import Daemon, free_port, wait_for
from tests.support import tcp_ready
from tests.support.operator_support import ROOT, feedline, wait_gone

BOUND = 15.0  # seconds a child may take to notice its parent died and exit


def _python(code: str, tmp_path: Path, name: str) -> subprocess.Popen[str]:
    script = tmp_path / f"{name}.py"
    script.write_text(textwrap.dedent(code))
    return subprocess.Popen([sys.executable, str(script)], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})


def _descendants(pid: int) -> list[int]:
    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def test_a_child_process_ends_when_its_parent_is_killed_9(tmp_path):
    parent = _python("""
        import sys, time
        from feedline.procs import Child
        c = Child([sys.executable, "-c", "import time; time.sleep(300)"])
        print(c.pid, flush=True)
        time.sleep(300)
    """, tmp_path, "parent")
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    parent.kill()
    parent.wait(10)
    assert wait_gone([child], BOUND) == [], "the child outlived its parent"


def test_a_worker_busy_in_its_map_function_ends_when_its_parent_is_killed_9(tmp_path):
    """A forked map worker blocked in user code (a slow decode) cannot poll for its parent:
    it must still go when the parent does."""
    busy = tmp_path / "busy"
    busy.mkdir()
    parent = _python(f"""
        import os, time
        from feedline.producer.dataflow import DataFromList, MultiProcessMapData

        def slow(x):
            open(os.path.join({str(busy)!r}, str(os.getpid())), "w").close()
            time.sleep(300)
            return x

        df = MultiProcessMapData(DataFromList(list(range(8)), shuffle=False), 2, slow,
                                 buffer_size=4, chunk=1)
        df.reset_state()
        print("started", flush=True)
        next(iter(df))
    """, tmp_path, "pipeline")
    assert parent.stdout is not None
    assert parent.stdout.readline().strip() == "started"
    # Both workers inside the map function (a parent-liveness poll between jobs cannot run).
    workers = [int(p.name) for p in wait_for(lambda: list(busy.iterdir()) if
                                             len(list(busy.iterdir())) >= 2 else None, 20,
                                             what="2 busy workers")]
    parent.kill()
    parent.wait(10)
    assert wait_gone(workers, BOUND) == [], "map workers outlived their parent"


def test_the_demo_killed_9_takes_its_broker_and_producers_with_it(tmp_path):
    demo = Daemon("feedline.commands", ["demo", "--no-train", "--duration", "300", "--producers",
                                        "1",
                               "--workdir", str(tmp_path / "work")], tmp_path / "demo.log",
                  env={"PYTHONPATH": str(ROOT)})
    try:
        wait_for(lambda: (tmp_path / "work" / "egress.sock").exists() or not demo.alive(), 60,
                 what="the demo's broker")
        assert demo.alive(), demo.log_text()
        children = wait_for(lambda: _descendants(demo.pid) if len(_descendants(demo.pid)) >= 2
                            else None, 30, what="broker and producer processes")
    finally:
        demo.kill9()
    assert wait_gone(children, BOUND) == [], "the demo's daemons outlived it"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_producer_with_worker_processes_leaves_no_temp_directory(daemons, tmp_path, sig):
    port = free_port()
    broker = daemons("feedline.broker", "--ingress", f"tcp://127.0.0.1:{port}", "--egress",
                     f"ipc://{tmp_path}/egress.sock", "--metrics-port", "0", name="broker")
    wait_for(lambda: tcp_ready(port) or not broker.alive(), 20, what="broker")
    cfg = tmp_path / "p.yaml"
    cfg.write_text("source: {fake: {shapes: [[4]], size: 64}}\n"
                   "parallel: {mode: process, workers: 2}\n"
                   "steps: [{map: {function: builtins:tuple}}, {batch: {batch_size: 4}}]\n")
    temp = tmp_path / "tmp"
    temp.mkdir()
    metrics = free_port()
    producer = Daemon("feedline.producer", ["--config", str(cfg), "--broker", f"tcp://127.0.0.1:{port}",
                                   "--metrics-port", str(metrics)], tmp_path / "producer.log",
                      env={"PYTHONPATH": str(ROOT), "TMPDIR": str(temp)})
    try:
        wait_for(lambda: list(temp.glob("feedline-df-*")) or not producer.alive(), 30,
                 what="the workers' directory")
        assert producer.alive(), producer.log_text()
        workers = _descendants(producer.pid)
        producer.signal(sig)
        assert producer.proc.wait(20) == 0, producer.log_text()
    finally:
        producer.stop()
    assert list(temp.iterdir()) == [], producer.log_text()
    assert wait_gone(workers, BOUND) == []


def test_a_failed_lmdb_build_leaves_nothing_and_the_next_run_succeeds(tmp_path):
    from tests.support.jpeg_data import make_folder

    make_folder(tmp_path / "images", classes=1, per_class=3)
    images = tmp_path / "images" / "c0"
    (images / "9999.jpg").symlink_to(tmp_path / "gone.jpg")  # unreadable, read last
    out = tmp_path / "out" / "train.lmdb"
    r = feedline("lmdb", "build", str(images.parent), str(out), "--no-progress")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "9999.jpg" in r.stderr and "nothing was written" in r.stderr
    assert not out.parent.exists() or list(out.parent.iterdir()) == []
    (images / "9999.jpg").unlink()
    r = feedline("lmdb", "build", str(images.parent), str(out), "--no-progress")
    assert r.returncode == 0, r.stderr
    assert "wrote 3 images" in r.stdout


def _sigint_as_in_a_terminal() -> None:
    """A terminal starts a command with SIGINT at its default. A test run started in the
    background by a non-interactive shell ignores SIGINT, every child inherits that, and
    Python then leaves Ctrl-C ignored (as it should): this test would wait for nothing."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_in_the_demo_is_one_line_and_stops_everything(tmp_path):
    demo = subprocess.Popen(
        [sys.executable, "-m", "feedline.commands", "demo", "--no-train", "--duration", "300",
         "--producers", "1", "--workdir", str(tmp_path / "work")],
        cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        # PYTHONFAULTHANDLER: if it hangs, SIGABRT makes it print every thread's stack.
        env={**os.environ, "PYTHONPATH": str(ROOT), "PYTHONFAULTHANDLER": "1"},
        start_new_session=True, preexec_fn=_sigint_as_in_a_terminal)
    children: list[int] = []
    try:
        wait_for(lambda: (tmp_path / "work" / "egress.sock").exists() or demo.poll() is not None,
                 60, what="the demo's broker")
        children = wait_for(lambda: _descendants(demo.pid) if len(_descendants(demo.pid)) >= 2
                            else None, 30, what="broker and producer processes")
        os.killpg(demo.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole group
        try:
            _, err = demo.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            # Say where the demo was, not only that it hung.
            demo.send_signal(signal.SIGABRT)
            _, err = demo.communicate(timeout=30)
            pytest.fail(f"the demo did not stop within 60s of Ctrl-C; its stderr and "
                        f"threads:\n{err[-12000:]}")
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
            demo.wait(10)
    assert demo.returncode == 130, err
    assert "Traceback" not in err, err
    assert [line for line in err.splitlines() if line.strip()] == [
        "feedline demo: interrupted; the broker and the producers are stopped"], err
    assert wait_gone(children, BOUND) == []
