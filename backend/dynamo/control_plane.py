"""Dynamo's control and event planes as a cluster runs them: etcd (discovery: workers register, the frontend watches)
and NATS with JetStream (KV events and load to every router), Debian's `etcd-server` and `nats-server`
(scripts/cluster_env.sh installs them).

`Planes.env` gives the processes of a cluster the variables Dynamo reads (`ETCD_ENDPOINTS`, `NATS_SERVER`). Where the
environment names none, `start_planes` starts both here on loopback, each with its own data folder, for a cluster
on this host; several hosts point every process at the same endpoints instead.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Planes:
    """The etcd and NATS endpoints a cluster uses, and the processes when they were started here."""

    etcd: str  # e.g. http://127.0.0.1:2379
    nats: str  # e.g. nats://127.0.0.1:4222
    procs: tuple[subprocess.Popen, ...] = ()  # etcd's, then NATS's
    run_dir: Path | None = None  # their data and logs
    nats_monitor: str = ""  # NATS's monitoring endpoint (/connz, /subsz) when started here

    def env(self) -> dict[str, str]:
        return {"DYN_DISCOVERY_BACKEND": "etcd", "ETCD_ENDPOINTS": self.etcd, "NATS_SERVER": self.nats,
                "DYN_EVENT_PLANE": "nats"}

    def restart(self, name: str, timeout: float = 60.0) -> None:
        """Stop etcd or NATS (`name`) and start it again as it was, on its port with its data (what a cluster does
        then: docs/dynamo.md, several hosts). For NATS, returns once every client is connected and subscribed again
        as before (the frontend's and workers' NATS clients reconnect with a backoff of their own: KV events sent
        before then are lost)."""
        i = ("etcd", "nats").index(name)
        before = self.nats_clients() if name == "nats" else None
        old = self.procs[i]
        old.terminate()
        old.wait(10)
        started = time.monotonic()
        log = self.run_dir / f"{name}.log"
        new = subprocess.Popen(old.args, stdout=log.open("a"), stderr=subprocess.STDOUT, start_new_session=True)
        self.procs = tuple(new if j == i else p for j, p in enumerate(self.procs))
        host, port = (self.etcd, self.nats)[i].rsplit("/", 1)[1].rsplit(":", 1)
        _wait_port(host, int(port), new, name, log)
        now = (0, 0)
        while before is not None and not (now[0] >= before[0] and now[1] >= before[1]):
            if time.monotonic() - started > timeout:
                raise TimeoutError(f"NATS clients did not reconnect within {timeout:.0f} s: (connections, "
                                   f"subscriptions) {now}, before the restart {before}")
            time.sleep(0.1)
            try:
                now = self.nats_clients()
            except OSError:  # its monitoring port not listening yet
                pass

    def nats_clients(self) -> tuple[int, int]:
        """NATS's (connections, subscriptions), from its monitoring endpoint."""
        with urllib.request.urlopen(f"{self.nats_monitor}/connz", timeout=5) as r:
            connections = json.load(r)["num_connections"]
        with urllib.request.urlopen(f"{self.nats_monitor}/subsz", timeout=5) as r:
            return connections, json.load(r)["num_subscriptions"]

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(host: str, port: int, proc: subprocess.Popen, name: str, log: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with code {proc.returncode}; its log ({log}) ends:\n"
                               f"{log.read_text()[-2000:]}")
        with socket.socket() as s:
            if s.connect_ex((host, port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError(f"{name} did not listen on {host}:{port} within {timeout:.0f} s (log {log})")


def start_planes(run_dir: Path, host: str = "127.0.0.1", wrap: Callable[[list[str]], list[str]] = list) -> Planes:
    """etcd and NATS (JetStream) on `host`'s ports (loopback, or a host of its own: hosts.py, whose namespace
    `wrap` runs a command in), data and logs under `run_dir`; or, when the environment names them
    (`ETCD_ENDPOINTS` and `NATS_SERVER`), those."""
    if os.environ.get("ETCD_ENDPOINTS") and os.environ.get("NATS_SERVER"):
        return Planes(os.environ["ETCD_ENDPOINTS"], os.environ["NATS_SERVER"])
    missing = [b for b in ("etcd", "nats-server") if shutil.which(b) is None]
    if missing:
        raise RuntimeError(f"discovery etcd: {' and '.join(missing)} not found (bash scripts/cluster_env.sh installs "
                           f"Debian's etcd-server and nats-server)")
    run_dir.mkdir(parents=True, exist_ok=True)
    client, peer, nats, monitor = _free_port(), _free_port(), _free_port(), _free_port()
    procs = []

    def spawn(name: str, argv: list[str], port: int) -> None:
        log = run_dir / f"{name}.log"
        proc = subprocess.Popen(wrap(argv), stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(proc)
        _wait_port(host, port, proc, name, log)

    try:
        spawn("etcd", ["etcd", "--data-dir", str(run_dir / "etcd-data"),
                       "--listen-client-urls", f"http://{host}:{client}",
                       "--advertise-client-urls", f"http://{host}:{client}",
                       "--listen-peer-urls", f"http://{host}:{peer}",
                       "--initial-advertise-peer-urls", f"http://{host}:{peer}",
                       "--initial-cluster", f"default=http://{host}:{peer}"], client)
        spawn("nats", ["nats-server", "-js", "-a", host, "-p", str(nats), "-m", str(monitor), "-sd",
                       str(run_dir / "jetstream")], nats)
    except BaseException:
        Planes("", "", tuple(procs)).stop()
        raise
    return Planes(f"http://{host}:{client}", f"nats://{host}:{nats}", tuple(procs), run_dir, f"http://{host}:{monitor}")
