"""`make serve-dynamo`: Dynamo's frontend (OpenAI API, KV-aware router) and N engine workers on one host.

Discovery `file` (the default): a fresh folder, no etcd or NATS, KV events over ZMQ. Discovery `etcd`: Dynamo's
cluster planes, etcd for discovery and NATS JetStream for KV events and load (control_plane.py: the ones
`ETCD_ENDPOINTS` / `NATS_SERVER` name, else started here). Every plane on 127.0.0.1, or with `--hosts` each process
on a host of its own (a network namespace with its own address: hosts.py). The model folder is
prepared once, before the workers start. Each worker gets an equal share of the CPU's threads. The
launcher prints when the endpoint is ready, says which worker died if one does (the frontend drops a
worker whose discovery entry goes with it and routes to the others), and stops everything on Ctrl-C.

    python -m backend.dynamo.launcher --workers 2 --http-port 8080 [-- --max-num-seqs 32 ...]

Arguments after `--` go to every worker (engine settings, `--dyn-tool-call-parser hermes`: python -m
backend.dynamo.worker --help). `--planner JSON` (with `--discovery etcd`): Dynamo's planner in its load mode adds and
stops workers between `--min-workers` and `--max-workers` (scaling.py; disaggregated, prefill and decode workers apart).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from backend.dynamo.control_plane import Planes, start_planes
from backend.dynamo.hosts import Hosts
from backend.serving.model_store import MODEL_NAME, resolve_model_dir
from backend.serving.openmp_env import openmp_env

ROUTER_MODES = ("kv", "round-robin", "random")
DISCOVERY = ("file", "etcd")


@dataclass
class Cluster:
    """Processes started by `start`; `stop` ends them all (SIGTERM, then SIGKILL after `grace` seconds)."""

    frontend: subprocess.Popen
    workers: list[subprocess.Popen]
    log_dir: Path  # frontend.log, worker0.log, ...
    url: str
    planes: Planes | None = None  # discovery etcd: etcd and NATS (stopped with the cluster when started for it)
    spawn_worker: Callable[[str, int], subprocess.Popen] | None = None  # (role, index): one more worker
    served_model_name: str = MODEL_NAME
    hosts: Hosts | None = None  # hosts of their own: planes, frontend, worker0, ... (removed with the cluster)
    env: dict[str, str] | None = None  # for another Dynamo process on this host's loopback (a planner, a probe)
    spawn: Callable[..., subprocess.Popen] | None = None  # (name, `python -m` argv, pipe, env): beside the workers
    others: list[subprocess.Popen] = field(default_factory=list)  # stopped with the cluster (the planner, scaler)
    stopped: set[int] = field(default_factory=set)  # workers stop_worker stopped
    roles: list[str] = field(default_factory=list)  # each worker's: both, prefill or decode

    def worker_address(self, index: int) -> str:
        """Where worker `index` serves its metrics and system endpoints (port: the frontend's + 1 + index)."""
        return self.hosts.addresses[f"worker{index}"] if self.hosts else "127.0.0.1"

    def add_worker(self, role: str = "both", timeout: float = 300.0) -> int:
        """Start one more worker, which joins through discovery; returns its index once the frontend routes to it."""
        before = serving_workers(self.url)
        self.workers.append(self.spawn_worker(role, len(self.workers)))
        self.roles.append(role)
        wait_ready(self, self.served_model_name, before + 1, timeout, watch=[len(self.workers) - 1])
        return len(self.workers) - 1

    def stop_worker(self, index: int, graceful: bool = True, timeout: float = 60.0) -> int:
        """SIGTERM (Dynamo's graceful shutdown: the worker unregisters, then finishes its streams in flight) or
        SIGKILL; returns its exit code."""
        proc = self.workers[index]
        self.stopped.add(index)
        proc.send_signal(signal.SIGTERM if graceful else signal.SIGKILL)
        return proc.wait(timeout)

    def start_beside(self, name: str, argv: list[str], pipe: bool = False, **env: str) -> subprocess.Popen:
        """`python -m argv` as `name` beside the workers (spawn), stopped with the cluster."""
        self.others.append(self.spawn(name, argv, pipe, **env))
        return self.others[-1]

    def start_planner(self, config: dict, **env: str) -> subprocess.Popen:
        """Dynamo's planner on this cluster (planner.py: `config` is dynamo.planner's, JSON); it logs to planner.log
        in log_dir."""
        return self.start_beside("planner", ["backend.dynamo.planner", "--config", json.dumps(config)], **env)

    def stop(self, grace: float = 10.0) -> None:
        procs = [*self.others, *self.workers, self.frontend]
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if self.planes is not None:
            self.planes.stop()
        if self.hosts is not None:
            self.hosts.remove()


def port_in_use(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def environment(discovery_dir: Path, threads: int, planes: Planes | None = None,
                address: str = "127.0.0.1") -> dict[str, str]:
    """A process's environment: `address` is its host's (every server it opens listens and is reached there)."""
    env = openmp_env(dict(os.environ))
    env.update({
        "DYN_DISCOVERY_BACKEND": "file", "DYN_FILE_KV": str(discovery_dir),
        "DYN_REQUEST_PLANE": "tcp", "DYN_EVENT_PLANE": "zmq",
        "DYN_TCP_RPC_HOST": address, "DYN_TCP_RESPONSE_STREAM_HOST": address,
        "DYN_EVENT_PLANE_HOST": address, "DYN_SYSTEM_HOST": address,
        "DYN_SELF_HOST_METADATA": "0",  # one host: the model card is read from the shared discovery folder
        "OMP_NUM_THREADS": str(threads),
    })
    if address != "127.0.0.1":  # a host of its own on this kernel: UCX would see one node and read the other
        env.setdefault("UCX_TLS", "tcp")  # process's memory directly (CMA); NIXL's KV READs go over its address
    if planes is not None:
        del env["DYN_FILE_KV"]
        env.update(planes.env())
    return env


def start(workers: int = 2, http_port: int = 8080, router_mode: str = "kv", model: str = "default",
          served_model_name: str = MODEL_NAME, worker_args: tuple[str, ...] = (), log_dir: Path | None = None,
          threads_per_worker: int | None = None, python: str = sys.executable, prefill_workers: int = 0,
          decode_workers: int = 0, conditional_disagg: str | None = None, discovery: str = "file",
          hosts: bool = False) -> Cluster:
    """Start the frontend and `workers` workers (plus `prefill_workers` and `decode_workers` for the
    disaggregated layout); returns once the model is served by all of them. `conditional_disagg` (JSON for
    Dynamo's `--router-conditional-disagg-config`) turns on the router's rule for keeping a request on the
    decode worker: with policy `isl_bounding`, when its uncached tokens on that worker are fewer than
    `eff_isl_threshold` (default 2048) AND under `eff_isl_ratio_threshold` (0.7) of the prompt.

    `discovery`: `file` (one host, no etcd or NATS) or `etcd` (etcd and NATS JetStream: control_plane.py).
    `hosts` (etcd only; root): the planes, the frontend and each worker on a host of their own (hosts.py), reached
    at their addresses on its bridge (`Cluster.url`, `Cluster.worker_address`).
    `python` is .venv-dynamo's interpreter (the launcher itself imports nothing from Dynamo, so tests
    start a cluster from the main venv). Worker i serves its metrics on port `http_port + 1 + i` of
    `Cluster.worker_address(i)` (127.0.0.1 without `hosts`).
    """
    if discovery not in DISCOVERY:
        raise ValueError(f"discovery: expected one of {DISCOVERY}, got {discovery!r}")
    if router_mode not in ROUTER_MODES:
        raise ValueError(f"router_mode: expected one of {ROUTER_MODES}, got {router_mode!r}")
    if hosts and discovery != "etcd":
        raise ValueError("hosts: hosts of their own need discovery etcd")
    if (prefill_workers > 0) != (decode_workers > 0):
        raise ValueError("prefill_workers, decode_workers: the disaggregated layout needs at least one of each")
    roles = ["both"] * workers + ["prefill"] * prefill_workers + ["decode"] * decode_workers
    if not hosts and port_in_use("127.0.0.1", http_port):
        raise RuntimeError(f"http_port: 127.0.0.1:{http_port} is in use (another server? pick --http-port)")
    model_dir = resolve_model_dir(model)  # once, before N workers would each prepare it
    run_dir = Path(tempfile.mkdtemp(prefix="serve-dynamo-"))
    threads = threads_per_worker or max(1, (os.cpu_count() or 1) // len(roles))
    log_dir = log_dir or run_dir
    machines = Hosts.create() if hosts else None
    try:
        planes = None
        if discovery == "etcd" and machines is None:
            planes = start_planes(run_dir / "planes")
        elif discovery == "etcd":
            planes = start_planes(run_dir / "planes", machines.add("planes"),
                                  functools.partial(machines.wrap, "planes"))
    except BaseException:
        if machines is not None:
            machines.remove()
        raise
    planes_args = ["--discovery-backend", discovery] + (["--event-plane", "nats"] if planes else [])

    def spawn(name: str, argv: list[str], pipe: bool = False, **extra_env: str) -> subprocess.Popen:
        """`python -m argv` as `name`: with `hosts`, on a host of its own (its servers on its address). Its output
        goes to <name>.log; with `pipe`, its stdin and stdout are pipes (text lines) and only stderr goes there."""
        address = machines.add(name) if machines else "127.0.0.1"
        command = [python, "-m", *argv]
        log = (log_dir / f"{name}.log").open("w")
        return subprocess.Popen(machines.wrap(name, command) if machines else command,
                                env={**environment(run_dir / "discovery", threads, planes, address), **extra_env},
                                stdin=subprocess.PIPE if pipe else None, stdout=subprocess.PIPE if pipe else log,
                                stderr=log if pipe else subprocess.STDOUT, text=pipe, bufsize=1 if pipe else -1,
                                start_new_session=True)

    # --migration-limit: a request whose worker dies mid-stream continues on another worker
    conditional = ["--router-conditional-disagg", "--router-conditional-disagg-config", conditional_disagg] \
        if conditional_disagg else []
    frontend = spawn("frontend", ["dynamo.frontend", "--http-host", "0.0.0.0" if machines else "127.0.0.1",
                                  "--http-port", str(http_port), "--router-mode", router_mode,
                                  "--discovery-backend", discovery, "--migration-limit", "3", *conditional])

    def spawn_worker(role: str, i: int) -> subprocess.Popen:
        # prefill workers in a component of their own, as Dynamo's own are: its planner counts and reads them there
        component = ["--component", "prefill"] if role == "prefill" else []
        return spawn(f"worker{i}", ["backend.dynamo.worker", "--model", str(model_dir), "--role", role, *component,
                                    "--served-model-name", served_model_name, *planes_args, *worker_args],
                     DYN_SYSTEM_PORT=str(http_port + 1 + i))

    procs = [spawn_worker(role, i) for i, role in enumerate(roles)]
    host = machines.addresses["frontend"] if machines else "127.0.0.1"
    cluster = Cluster(frontend, procs, log_dir, f"http://{host}:{http_port}", planes, spawn_worker,
                      served_model_name, machines, environment(run_dir / "discovery", threads, planes), spawn,
                      roles=roles)
    try:
        wait_ready(cluster, served_model_name, len(roles))
    except BaseException:
        cluster.stop()
        raise
    return cluster


def serving_workers(url: str) -> int:
    """Workers the frontend knows for the generate endpoint (its /health lists discovery's instances)."""
    with urllib.request.urlopen(url + "/health", timeout=5) as r:
        health = json.load(r)
    return sum(1 for i in health.get("instances", []) if i.get("endpoint") == "generate")


def wait_ready(cluster: Cluster, model: str, workers: int, timeout: float = 300.0,
               watch: list[int] | None = None) -> None:
    """Until the frontend serves `model` on `workers` workers; raises if the frontend or a watched worker (default:
    all) exits first."""
    deadline = time.monotonic() + timeout
    watched = range(len(cluster.workers)) if watch is None else watch
    while time.monotonic() < deadline:
        for name, p in [("frontend", cluster.frontend), *((f"worker{i}", cluster.workers[i]) for i in watched)]:
            if p.poll() is not None:
                log = cluster.log_dir / f"{name}.log"
                tail = log.read_text()[-3000:] if log.exists() else ""
                raise RuntimeError(f"{name} exited with code {p.returncode} before the cluster was ready; "
                                   f"its log ({log}) ends:\n{tail}")
        try:
            with urllib.request.urlopen(cluster.url + "/v1/models", timeout=5) as r:
                served = [m["id"] for m in json.load(r)["data"]]
            if model in served and serving_workers(cluster.url) >= workers:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the cluster was not ready within {timeout:.0f} s (logs in {cluster.log_dir})")


def main() -> None:
    argv = sys.argv[1:]
    worker_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, worker_args = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=int(os.environ.get("WORKERS", 2)), help="aggregated workers")
    p.add_argument("--prefill-workers", type=int, default=0, help="with --decode-workers: disaggregated layout")
    p.add_argument("--decode-workers", type=int, default=0)
    p.add_argument("--conditional-disagg", default=None, metavar="JSON",
                   help='the router\'s conditional rule, e.g. \'{"policy": "isl_bounding", "eff_isl_threshold": 512}\': '
                        'a request mostly cached on its decode worker is prefilled there (docs/dynamo.md)')
    p.add_argument("--http-port", type=int, default=8080)
    p.add_argument("--router-mode", default="kv", choices=ROUTER_MODES)
    p.add_argument("--discovery", default="file", choices=DISCOVERY,
                   help="file: one host, no etcd or NATS; etcd: etcd discovery and NATS JetStream events, those "
                        "ETCD_ENDPOINTS / NATS_SERVER name or started here (docs/dynamo.md)")
    p.add_argument("--hosts", action="store_true",
                   help="with --discovery etcd (root): etcd + NATS, the frontend and each worker in a network "
                        "namespace of its own, each with its own address on a bridge (hosts.py)")
    p.add_argument("--model", default="default", help="HF folder, or `default` (SmolLM2 from the model store)")
    p.add_argument("--served-model-name", default=MODEL_NAME)
    p.add_argument("--planner", default=None, metavar="JSON",
                   help='with --discovery etcd: Dynamo\'s planner in load mode adds and stops workers (scaling.py), its '
                        'thresholds e.g. \'{"decode_scale_up_kv_rate": 70, "decode_scale_down_kv_rate": 10}\' '
                        '(docs/dynamo.md)')
    p.add_argument("--min-workers", type=int, default=1,
                   help="with --planner: the fewest workers it keeps (of each role, disaggregated)")
    p.add_argument("--max-workers", type=int, default=4,
                   help="with --planner: the most workers it starts (of each role, disaggregated)")
    args = p.parse_args(argv)
    if args.planner and args.discovery != "etcd":
        p.error("--planner: needs --discovery etcd (the planner's decisions are kept there)")
    for sig in (signal.SIGINT, signal.SIGTERM):  # `kill` stops the cluster as Ctrl-C does; SIGINT may start
        signal.signal(sig, signal.default_int_handler)  # ignored (a background job of a script)
    if args.prefill_workers or args.decode_workers:
        args.workers = 0
    layout = (f"{args.prefill_workers} prefill + {args.decode_workers} decode workers" if args.prefill_workers
              else f"{args.workers} workers")
    print(f"starting the frontend ({args.router_mode} router) and {layout} ...", flush=True)
    try:
        cluster = start(args.workers, args.http_port, args.router_mode, args.model, args.served_model_name,
                        tuple(worker_args), prefill_workers=args.prefill_workers,
                        decode_workers=args.decode_workers, conditional_disagg=args.conditional_disagg,
                        discovery=args.discovery, hosts=args.hosts)
    except (RuntimeError, ValueError, OSError) as err:  # port in use, bad model folder, a process died, timeout
        sys.exit(f"serve-dynamo: {err}")
    n = len(cluster.workers)
    if args.planner:
        from backend.dynamo.scaling import Autoscaler

        Autoscaler(cluster, json.loads(args.planner), args.min_workers, args.max_workers)
    print(f"ready: OpenAI API on {cluster.url}/v1 (model {args.served_model_name!r}, {layout}, "
          f"their metrics on ports {args.http_port + 1}..{args.http_port + n}"
          f"{' of their hosts: ' + str(cluster.hosts.addresses) if cluster.hosts else ''}); "
          f"{'the planner adds and stops workers (decisions.log); ' if args.planner else ''}"
          f"logs in {cluster.log_dir}; Ctrl-C stops everything", flush=True)
    gone: set[int] = set()  # workers that exited (those the planner stopped are not reported)
    try:
        while cluster.frontend.poll() is None and len(gone) < len(cluster.workers):
            for i, worker in enumerate(list(cluster.workers)):
                if i not in gone and worker.poll() is not None:
                    gone.add(i)
                    if i not in cluster.stopped:
                        print(f"worker{i} exited with code {worker.returncode} (log {cluster.log_dir}/worker{i}.log); "
                              f"{len(cluster.workers) - len(gone)} still serving", flush=True)
            time.sleep(1)
        print("the frontend exited" if cluster.frontend.poll() is not None else "every worker exited", flush=True)
        code = 1
    except KeyboardInterrupt:
        code = 0
    for sig in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C must not cut the shutdown short
        signal.signal(sig, signal.SIG_IGN)
    print("stopping ...", flush=True)
    cluster.stop()
    sys.exit(code)


if __name__ == "__main__":
    main()
