"""deploy/: the launchd plists and systemd units that install-macos.sh and install-linux.sh write,
checked as their service managers would read them (plistlib plus our own rules; systemd-analyze
verify), and the Linux install exercised for real: installed into a temporary prefix, then,
since systemd is not PID 1 here, its units' own command lines started the way systemd would,
with the restarts its Restart=always does. Restarting the gateway or the cache service loses no
cached block."""
import os
import pathlib
import plistlib
import shlex
import shutil
import signal
import subprocess
import time
import tomllib

import openai
import pytest

from test_api import Cluster, pick_port

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"


def install(script, bin_dir, tmp, *extra):
    dirs = {name: tmp / name for name in ("prefix", "kv", "run", "log", "out")}
    jaeger = tmp / "jaeger"
    jaeger.write_text("#!/bin/sh\nexec sleep 1000\n")
    jaeger.chmod(0o755)
    target = "--agent-dir" if "macos" in script else "--unit-dir"
    subprocess.run(
        ["bash", DEPLOY / script, "--prefix", dirs["prefix"], "--from", bin_dir,
         "--kv-dir", dirs["kv"], "--run-dir", dirs["run"], "--log-dir", dirs["log"],
         target, dirs["out"], "--jaeger", jaeger, "--no-start", *extra],
        check=True, capture_output=True, text=True)
    return dirs


def test_launchd_plists_are_valid_and_complete(bin_dir, tmp_path):
    d = install("install-macos.sh", bin_dir, tmp_path)
    plists = sorted(d["out"].glob("*.plist"))
    assert [p.name for p in plists] == [
        "dev.strata.gateway.plist", "dev.strata.jaeger.plist", "dev.strata.kvcache.plist"]
    for path in plists:
        raw = path.read_bytes()
        assert b"@" not in raw.replace(b"@PREFIX", b""), f"{path.name}: unfilled placeholder"
        p = plistlib.loads(raw)
        assert p["Label"] == path.stem
        program = p["ProgramArguments"]
        assert program and all(isinstance(a, str) for a in program)
        assert os.path.isabs(program[0]) and os.access(program[0], os.X_OK), program[0]
        assert p["RunAtLoad"] is True
        assert p["KeepAlive"], f"{path.name}: KeepAlive"
        assert isinstance(p["ThrottleInterval"], int) and p["ThrottleInterval"] >= 1
        for key in ("StandardOutPath", "StandardErrorPath"):
            assert pathlib.Path(p[key]).parent == d["log"], (path.name, key)

    kv = plistlib.loads((d["out"] / "dev.strata.kvcache.plist").read_bytes())
    args = kv["ProgramArguments"]
    assert args[1] == "serve" and args[args.index("--dir") + 1] == str(d["kv"])
    assert args[args.index("--socket") + 1] == str(d["run"] / "kvcache.sock")
    # Runs only while the cache directory (the chosen SSD) is there.
    assert kv["KeepAlive"] == {"PathState": {str(d["kv"]): True}}
    assert kv["ExitTimeOut"] >= 10 and kv["Umask"] == 0o077

    jaeger = plistlib.loads((d["out"] / "dev.strata.jaeger.plist").read_bytes())
    assert jaeger["ProgramArguments"] == [str(tmp_path / "jaeger")]
    assert jaeger["KeepAlive"] is True

    gw = plistlib.loads((d["out"] / "dev.strata.gateway.plist").read_bytes())
    config = pathlib.Path(gw["ProgramArguments"][gw["ProgramArguments"].index("--config") + 1])
    assert gw["KeepAlive"] is True and "--external-kvcache" in gw["ProgramArguments"]
    assert gw["EnvironmentVariables"]["DYLD_LIBRARY_PATH"] == str(d["prefix"] / "lib/strata")
    toml = tomllib.loads(config.read_text())
    assert toml["cache"] == {"dir": str(d["kv"]), "ram": "1GiB", "disk": "20GiB",
                             "socket": str(d["run"] / "kvcache.sock"), "external": True}
    uninstall("uninstall-macos.sh", "--agent-dir", d)


def unit(path):
    """A unit file as {section: [(key, value)]} (keys repeat: Environment, ExecStartPre)."""
    sections, current = {}, None
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), [])
        else:
            key, _, value = line.partition("=")
            current.append((key, value))
    return sections


def test_systemd_units_pass_systemd_analyze_verify(bin_dir, tmp_path):
    analyze = shutil.which("systemd-analyze")
    assert analyze, "systemd-analyze missing: scripts/setup installs the systemd package"
    d = install("install-linux.sh", bin_dir, tmp_path)
    units = sorted(d["out"].glob("*.service"))
    assert [u.name for u in units] == [
        "strata-gateway.service", "strata-jaeger.service", "strata-kvcache.service"]
    for u in units:
        r = subprocess.run([analyze, "verify", u], capture_output=True, text=True)
        # Any complaint (unknown key, missing binary, bad dependency) fails the check.
        assert r.returncode == 0 and r.stdout + r.stderr == "", f"{u.name}:\n{r.stdout}{r.stderr}"
        s = unit(u)
        assert ("Restart", "always") in s["Service"], u.name
        assert ("WantedBy", "default.target") in s["Install"], u.name
    gw = unit(d["out"] / "strata-gateway.service")
    assert ("Wants", "strata-kvcache.service") in gw["Unit"]
    assert ("KillMode", "mixed") in gw["Service"]
    kv = unit(d["out"] / "strata-kvcache.service")
    assert ("ConditionPathIsDirectory", str(d["kv"])) in kv["Unit"]
    # A broken unit is caught: the check is not vacuous.
    bad = tmp_path / "bad.service"
    bad.write_text((d["out"] / "strata-kvcache.service").read_text()
                   .replace("ExecStart=", "ExecStart=/nonexistent/strata-kvcache "))
    assert subprocess.run([analyze, "verify", bad], capture_output=True).returncode != 0
    uninstall("uninstall-linux.sh", "--unit-dir", d)


def uninstall(script, target_flag, d):
    """The uninstaller removes the service files and, with --prefix, the installed files,
    and keeps the cache directory and the config."""
    subprocess.run(["bash", DEPLOY / script, target_flag, d["out"], "--prefix", d["prefix"]],
                   check=True, capture_output=True)
    assert list(d["out"].iterdir()) == []
    assert not (d["prefix"] / "bin/strata").exists()
    assert not (d["prefix"] / "lib/strata").exists()
    assert d["kv"].is_dir() and (d["prefix"] / "etc/strata/strata.toml").is_file()


class Service:
    """One unit run as systemd would: ExecStartPre, then ExecStart with its Environment and
    its append: log, stopped with its KillSignal."""

    def __init__(self, path):
        s = unit(path)["Service"]
        self.pre = [shlex.split(v) for k, v in s if k == "ExecStartPre"]
        self.start = shlex.split(dict(s)["ExecStart"])
        self.env = dict(os.environ)
        self.env.update(v.split("=", 1) for k, v in s if k == "Environment")
        self.log = pathlib.Path(dict(s)["StandardOutput"].removeprefix("append:"))
        self.proc = None

    def run(self):
        for cmd in self.pre:
            subprocess.run(cmd, check=True, env=self.env)
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(self.start, env=self.env, stdout=open(self.log, "ab"),
                                     stderr=subprocess.STDOUT)
        return self.proc

    def stop(self, sig=signal.SIGTERM):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=40)


def test_linux_install_runs_the_units_and_restarts_lose_no_cached_block(
        bin_dir, default_model, tmp_path):
    port = pick_port()
    d = install("install-linux.sh", bin_dir, tmp_path, "--model", str(default_model),
                "--bind", f"127.0.0.1:{port}", "--kv-ram", "64MiB", "--kv-disk", "256MiB")
    # The install is self-contained: binaries, launcher, libmlx and docs in the prefix.
    for rel in ("bin/strata", "bin/strata-worker", "bin/strata-kvcache", "bin/strata-mlx-env",
                "lib/strata/libmlx.so", "share/doc/strata/README.md"):
        assert (d["prefix"] / rel).exists(), rel
    kvcache = Service(d["out"] / "strata-kvcache.service")
    gateway = Service(d["out"] / "strata-gateway.service")
    assert kvcache.start[0] == str(d["prefix"] / "bin/strata-kvcache")
    kvcache.run()
    gateway.run()
    cluster = Cluster(gateway.proc, port, d["run"], gateway.log)
    try:
        cluster.wait_ready(timeout_s=120)
        assert oct(d["run"].stat().st_mode & 0o777) == "0o700"
        # The gateway uses the unit's cache service instead of starting one of its own.
        assert "using the cache service already running" in gateway.log.read_text()
        assert "kvcache" not in {c["name"] for c in cluster.health()[1]["children"]}

        oai = openai.OpenAI(base_url=cluster.url + "/v1", api_key="x", max_retries=0)
        question = ("Here are some notes. " + " ".join(
            f"Note {i}: the service keeps its cache across restarts." for i in range(40))
            + " What do the notes say?")

        def ask():
            r = oai.chat.completions.create(
                model="default", messages=[{"role": "user", "content": question}],
                max_tokens=8, temperature=0)
            return r.choices[0].message.content, r.usage.model_extra[
                "strata_cached_tokens_by_tier"], r.usage.prompt_tokens

        cold, tiers, prompt_tokens = ask()
        assert prompt_tokens > 512 and sum(tiers.values()) == 0
        time.sleep(1)  # the blocks reach the cache service behind the answer

        # systemctl restart strata-gateway: the workers go with it, the cache stays.
        gateway.stop()
        gateway.run()
        cluster.proc = gateway.proc
        cluster.wait_ready(timeout_s=120)
        after_gateway, tiers, _ = ask()
        assert after_gateway == cold
        assert tiers["l0"] == 0 and tiers["l1"] + tiers["l2"] >= 512, tiers

        # The cache service crashes (kill -9) and systemd restarts it: what it wrote to disk
        # is served from the disk tier, and the gateway served on meanwhile.
        kvcache.stop(signal.SIGKILL)
        meanwhile, _, _ = ask()
        assert meanwhile == cold
        kvcache.run()
        gateway.stop()
        gateway.run()
        cluster.proc = gateway.proc
        cluster.wait_ready(timeout_s=120)
        after_both, tiers, _ = ask()
        assert after_both == cold
        assert tiers["l2"] >= 512, tiers
    finally:
        gateway.stop()
        kvcache.stop()
