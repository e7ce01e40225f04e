"""`strata up` starts the cache service and a worker, reports them healthy over HTTP, restarts a
worker that is killed, and stops everything cleanly on SIGTERM."""
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request

import pytest


def get_health(port: int):
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)
    except OSError:
        return None, None


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(0.1)
    pytest.fail(f"timed out waiting for {what}; last: {last!r}")


@pytest.fixture
def cluster(bin_dir, default_model, free_port, tmp_path, request):
    run_dir = tmp_path / "run"
    log = open(tmp_path / "strata.log", "wb")
    env = dict(os.environ, **getattr(request, "param", {}))
    proc = subprocess.Popen(
        [bin_dir / "strata", "up", "--bind", f"127.0.0.1:{free_port}",
         "--model", str(default_model), "--model-id", "smollm2", "--run-dir", str(run_dir),
         "--kv-dir", str(tmp_path / "kv"), "--kv-ram", "64MiB", "--kv-disk", "256MiB"],
        stdout=log, stderr=subprocess.STDOUT, env=env,
    )
    yield proc, free_port, run_dir
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    log.close()
    print((tmp_path / "strata.log").read_text())


def ready(port):
    status, body = get_health(port)
    return body if status == 200 else None


def test_up_serves_health_restarts_a_killed_worker_and_stops_on_sigterm(cluster):
    proc, port, run_dir = cluster
    body = wait_for(lambda: ready(port), 60, "all children ready")
    assert body["status"] == "ok"
    by_name = {c["name"]: c for c in body["children"]}
    assert set(by_name) == {"kvcache", "worker-smollm2"}
    worker = by_name["worker-smollm2"]
    # The worker answered its gRPC health with the MLX library it really loaded.
    assert "mlx 0.32.2 on cpu" in worker["detail"], worker
    # And the prefill pass chosen for the device (the CPU's).
    assert "prefill passes of 256 tokens" in worker["detail"], worker
    for name in ("kvcache.sock", "worker-0.sock"):
        mode = os.stat(run_dir / name).st_mode & 0o777
        assert mode == 0o600, f"{name} has mode {oct(mode)}"

    # kill -9 the worker: the gateway stays up, reports it, and brings it back.
    os.kill(worker["pid"], signal.SIGKILL)
    def restarted():
        status, b = get_health(port)
        if status != 200:
            return None
        w = {c["name"]: c for c in b["children"]}["worker-smollm2"]
        return w if w["restarts"] >= 1 and w["pid"] != worker["pid"] else None
    again = wait_for(restarted, 60, "worker restarted")
    assert "exited" in again["last_error"]
    assert proc.poll() is None, "the gateway must survive a worker's death"

    pids = [c["pid"] for c in get_health(port)[1]["children"]]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not (run_dir / "worker-0.sock").exists()
    assert not (run_dir / "kvcache.sock").exists()


@pytest.mark.parametrize("binary", ["strata", "strata-worker", "strata-kvcache"])
def test_every_binary_answers_help(bin_dir, binary):
    out = subprocess.run([bin_dir / binary, "--help"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert "Usage:" in out.stdout


@pytest.mark.parametrize("binary,args", [
    ("strata-worker", ["serve"]),
    ("strata-kvcache", ["serve", "--dir", "KVDIR"]),
])
def test_services_exit_cleanly_on_sigterm(bin_dir, tmp_path, binary, args):
    sock = tmp_path / f"{binary}.sock"
    args = [str(tmp_path / "kv") if a == "KVDIR" else a for a in args]
    proc = subprocess.Popen([bin_dir / binary, *args, "--socket", str(sock)],
                            stderr=subprocess.PIPE)
    wait_for(lambda: sock.exists(), 30, f"{binary} socket")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=15) == 0, proc.stderr.read().decode()
    assert not sock.exists()


# Twice: as on Linux (parent-death signal and the life line), and with the life line alone, as
# on macOS, which has no parent-death signal (a debug-build switch turns the signal off).
@pytest.mark.parametrize("cluster", [{}, {"STRATA_TEST_NO_PDEATHSIG": "1"}],
                         ids=["linux", "life-line-only"], indirect=True)
def test_workers_do_not_outlive_a_killed_gateway(cluster):
    proc, port, _ = cluster
    body = wait_for(lambda: ready(port), 60, "all children ready")
    children = {c["name"]: c for c in body["children"]}
    worker_pid, kvcache_pid = children["worker-smollm2"]["pid"], children["kvcache"]["pid"]
    proc.kill()  # SIGKILL: the gateway gets no chance to stop anything
    proc.wait()
    # The cache service outlives gateway restarts by design; this test stops it itself.
    os.kill(kvcache_pid, signal.SIGTERM)

    def gone():
        try:
            os.kill(worker_pid, 0)
            return False
        except ProcessLookupError:
            return True
    wait_for(gone, 15, "the orphaned worker to exit")


def test_up_refuses_a_missing_model_clearly(bin_dir, free_port, tmp_path):
    out = subprocess.run(
        [bin_dir / "strata", "up", "--bind", f"127.0.0.1:{free_port}",
         "--model", str(tmp_path / "nope.gguf"), "--run-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=30)
    assert out.returncode != 0
    assert "nope.gguf not found" in out.stderr
