"""Run a real tritonserver on a model repository, from the pytriton wheel's files or the container's own.

    python -m backend.triton.launcher --model-repository model_repository [--http-port 8000 ...] [-- <server args>]

By default it listens on 127.0.0.1 only (--host 0.0.0.0 opens it to the network) and restricts Triton's admin
APIs (ADMIN_APIS) to clients that send the header `admin-key: $TRITON_ADMIN_KEY` (over gRPC the metadata
`triton-grpc-protocol-admin-key`); with the variable unset, to no client (--open-admin-apis: to every client).
See docs/security.md.
"""

from __future__ import annotations

import argparse
import ctypes.util
import functools
import importlib.metadata
import importlib.util
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from backend.serving.openmp_env import openmp_env
from backend.triton.supervisor import STUB, Supervisor

LOG = logging.getLogger(__name__)
LOOPBACK = "127.0.0.1"
ADMIN_KEY_ENV = "TRITON_ADMIN_KEY"
ADMIN_HEADER = "admin-key"  # the HTTP header; gRPC metadata carries it under Triton's prefix:
GRPC_ADMIN_HEADER = f"triton-grpc-protocol-{ADMIN_HEADER}"
# Triton 2.51's API groups but health, metadata and inference (which stay open): shared-memory could map any
# /dev/shm region (our stubs' too), logging and trace change the server's files and verbosity, model-config
# and model-repository show paths and parameters, statistics every model's traffic.
ADMIN_APIS = ("shared-memory", "model-config", "model-repository", "statistics", "trace", "logging")
PY_VERSION = f"{sys.version_info.major}.{sys.version_info.minor}"
MiB = 1024 * 1024
STABLE_S = 600.0  # a server up this long counts as healthy: the restart backoff starts over


@dataclass(frozen=True)
class TritonInstall:
    root: Path  # holds bin/tritonserver and backends/
    libs_dir: Path | None = None  # the wheel's bundled shared libraries (nvidia_pytriton.libs)
    stubs_dir: Path | None = None  # the wheel's python_backend_stubs/<X.Y>/; None: backends/python has one


def _install_at(root: Path) -> TritonInstall:
    stubs, libs = root / "python_backend_stubs", root.parent.parent / "nvidia_pytriton.libs"
    return TritonInstall(root, libs if libs.is_dir() else None, stubs if stubs.is_dir() else None)


def find_tritonserver() -> TritonInstall:
    """$TRITONSERVER_HOME, else the container's /opt/tritonserver, else the pytriton wheel."""
    if home := os.environ.get("TRITONSERVER_HOME"):
        return _install_at(Path(home))
    if Path("/opt/tritonserver/bin/tritonserver").is_file():
        return TritonInstall(Path("/opt/tritonserver"))
    spec = importlib.util.find_spec("pytriton")  # finding a top-level package does not run its __init__
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("no tritonserver: set TRITONSERVER_HOME, use the tritonserver container "
                           "or `pip install --no-deps nvidia-pytriton`")
    return _install_at(Path(spec.submodule_search_locations[0]) / "tritonserver")


def _libpython_dir() -> Path | None:
    """The directory the stub must load libpython from to embed *this* Python (None: ld.so's default).

    Else it takes whatever libpython3.X.so.1.0 ld.so finds, e.g. Debian's 3.11.2 under pyenv's 3.11.7.
    """
    libdir, soname = Path(sysconfig.get_config_var("LIBDIR") or "/-"), sysconfig.get_config_var("INSTSONAME")
    if sysconfig.get_config_var("Py_ENABLE_SHARED") and (libdir / soname).exists():
        return None if libdir.is_relative_to("/usr/lib") or libdir.is_relative_to("/lib") else libdir
    if ctypes.util.find_library(f"python{PY_VERSION}") is None:
        fix = f"PYTHON_CONFIGURE_OPTS=--enable-shared pyenv install {PY_VERSION}"
        raise RuntimeError(f"{sys.executable} is linked statically and no libpython{PY_VERSION}.so is"
                           f" installed for the python backend stub to embed: use a shared Python ({fix})")
    LOG.warning("%s has no shared libpython: the stub embeds the system's libpython%s",
                sys.executable, PY_VERSION)
    return None


def _server_env(libs_dir: Path | None) -> dict[str, str]:
    """The stub embeds Python in isolated mode, so PYTHONPATH and PYTHONHOME are ignored; it finds its prefix
    by looking up `python3` on PATH. Our bin dir goes first: in a venv, pyvenv.cfg adds its site-packages."""
    env = dict(os.environ)
    ld_path = [str(d) for d in (_libpython_dir(), libs_dir) if d] + [env.get("LD_LIBRARY_PATH", "")]
    env["LD_LIBRARY_PATH"] = ":".join(filter(None, ld_path))
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return openmp_env(env)


@functools.cache  # once per stub
def _warn_if_stub_predates_numpy2(stub: Path) -> None:
    """Stubs built with pybind11 < 2.12 (Triton <= 2.51, as in the pytriton 0.7 wheel) misread numpy 2 arrays:
    pb_utils.Tensor(name, ndarray) sends 0 bytes, as_numpy() repeats element 0, BYTES inputs kill the stub.
    pybind11 >= 2.12 names the module numpy._core, so its absence gives such a stub away."""
    try:
        numpy_major = int(importlib.metadata.version("numpy").split(".")[0])
    except importlib.metadata.PackageNotFoundError:
        return
    if numpy_major >= 2 and stub.is_file() and b"numpy._core" not in stub.read_bytes():
        LOG.warning("%s predates numpy 2, which is installed: pass tensors by DLPack "
                    "(pb_utils.Tensor.from_dlpack, np.from_dlpack) and no strings, or use numpy<2", stub)


def prepare_runtime(install: TritonInstall, workdir: Path) -> tuple[Path, Path, dict[str, str]]:
    """(server binary, backend directory, env); for the wheel, a backends/ tree holding this Python's stub."""
    server_bin, env = install.root / "bin" / "tritonserver", _server_env(install.libs_dir)
    if install.stubs_dir is None:
        _warn_if_stub_predates_numpy2(install.root / "backends" / "python" / STUB)
        return server_bin, install.root / "backends", env
    stub = install.stubs_dir / PY_VERSION / STUB
    if not stub.is_file():
        raise RuntimeError(f"no python backend stub for Python {PY_VERSION} in {install.stubs_dir}")
    python_dir = workdir / "backends" / "python"
    python_dir.mkdir(parents=True, exist_ok=True)
    for src in (install.root / "backends" / "python").iterdir():
        if src.is_file() and not (python_dir / src.name).exists():
            (python_dir / src.name).symlink_to(src)
    # A copy, not a link: when the stub fails to run, the backend chmods it to u+x only.
    shutil.copy2(stub, python_dir / STUB)
    _warn_if_stub_predates_numpy2(stub)
    return server_bin, workdir / "backends", env


def admin_key_from_env() -> str:
    """$TRITON_ADMIN_KEY, else a random key that is printed nowhere: the admin APIs are then closed to all."""
    return os.environ.get(ADMIN_KEY_ENV) or secrets.token_urlsafe(32)


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


@dataclass
class TritonServer:
    """One tritonserver process; a port given as 0 is picked free at construction. A context manager."""

    model_repository: Path
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    log_verbose: int = 0
    extra_args: list[str] = field(default_factory=list)
    workdir: Path | None = None  # runtime tree and default log; a new temporary dir when None
    log_path: Path | None = None
    echo: bool = False  # also copy the server's output to stdout
    shm_default_bytes: int = 8 * MiB  # per model instance; the backend's default is 1 MiB
    shm_growth_bytes: int = 8 * MiB
    # Threads of the server's pool that serves python models' BLS calls: a streamed BLS call holds one for its
    # whole life, so the backend's default of 32 capped llm_bls at 32 concurrent requests (the rest queued
    # unseen by the engine, never refused as overloaded). Above max_num_seqs + max_waiting (64 + 256).
    bls_threads: int = 512
    exit_timeout_s: int = 10  # how long tritonserver waits for in-flight requests when stopping
    host: str = LOOPBACK  # the IPv4 address HTTP, gRPC and metrics listen on; 0.0.0.0: every interface
    # What ADMIN_APIS ask of a client in the ADMIN_HEADER; None: nothing (open to all). Kept out of repr:
    # tritonserver's command line is the only place it goes.
    admin_key: str | None = field(default_factory=admin_key_from_env, repr=False)
    shm_prefix: str = field(init=False)
    _proc: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)
    _pump: threading.Thread | None = field(default=None, init=False, repr=False)
    _started_at: float = field(default=0.0, init=False, repr=False)
    _own_workdir: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        picked = iter(free_ports(3))
        ports = (self.http_port, self.grpc_port, self.metrics_port)
        self.http_port, self.grpc_port, self.metrics_port = (port or next(picked) for port in ports)
        self.shm_prefix = f"triton_{os.getpid()}_{secrets.token_hex(4)}_"  # unique per server on a host
        self._own_workdir = self.workdir is None
        self.workdir = self.workdir or Path(tempfile.mkdtemp(prefix="tritonserver-"))
        self.log_path = self.log_path or self.workdir / "tritonserver.log"

    @property
    def _local_host(self) -> str:
        """The address a client on this host reaches it at."""
        return LOOPBACK if self.host == "0.0.0.0" else self.host

    @property
    def url_http(self) -> str:
        return f"http://{self._local_host}:{self.http_port}"

    @property
    def url_grpc(self) -> str:  # host:port, as tritonclient.grpc takes it
        return f"{self._local_host}:{self.grpc_port}"

    @property
    def url_metrics(self) -> str:
        return f"http://{self._local_host}:{self.metrics_port}/metrics"

    def start(self) -> None:
        assert self._proc is None and self.workdir and self.log_path, "already started"
        server_bin, backend_dir, env = prepare_runtime(find_tritonserver(), self.workdir)
        python_config = {"shm-region-prefix-name": self.shm_prefix,
                         "shm-default-byte-size": self.shm_default_bytes,
                         "shm-growth-byte-size": self.shm_growth_bytes, "thread-pool-size": self.bls_threads}
        restriction = f"{','.join(ADMIN_APIS)}:{ADMIN_HEADER}={self.admin_key}"
        restricted = [] if self.admin_key is None else [f"--http-restricted-api={restriction}",
                                                        f"--grpc-restricted-protocol={restriction}"]
        cmd = [str(server_bin), f"--model-repository={Path(self.model_repository).resolve()}",
               f"--backend-directory={backend_dir}", *restricted,
               f"--http-address={self.host}", f"--http-port={self.http_port}",
               f"--grpc-address={self.host}", f"--grpc-port={self.grpc_port}",
               f"--metrics-address={self.host}", f"--metrics-port={self.metrics_port}",
               f"--log-verbose={self.log_verbose}", f"--exit-timeout-secs={self.exit_timeout_s}",
               *(f"--backend-config=python,{key}={value}" for key, value in python_config.items()),
               *self.extra_args]
        self._started_at = time.monotonic()
        # Own session: a terminal's Ctrl-C reaches only us, and stop() can kill the stubs with the server.
        self._proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      start_new_session=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - the pump closes it; a restart appends
        self._pump = threading.Thread(target=self._copy_output, args=(self._proc.stdout, log), daemon=True)
        self._pump.start()

    def _copy_output(self, output: IO[bytes], log: IO[bytes]) -> None:
        """The server's and its stubs' output, to the log until the last of them exits. The file is this thread's
        alone: stop() gives it 5 s, and a restart opens the log anew, so a slow copy of a dead server's last lines
        (a crashed stub's stacks) still lands instead of meeting a closed file."""
        with log:
            for line in output:
                log.write(line)
                log.flush()
                if self.echo:
                    sys.stdout.write(line.decode(errors="replace"))
                    sys.stdout.flush()

    def log_tail(self, lines: int = 40) -> str:
        assert self.log_path
        if self._pump and self._proc and self._proc.poll() is not None:
            self._pump.join(timeout=2)  # let a dead server's last lines reach the file
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def wait_ready(self, timeout: float = 120.0) -> float:
        """Poll /v2/health/ready; seconds from start() to ready. Raises with the log's tail if it dies."""
        assert self._proc is not None, "not started"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if (code := self._proc.poll()) is not None:
                raise RuntimeError(f"tritonserver exited with {code}; {self.log_path}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url_http}/v2/health/ready", timeout=1) as resp:
                    if resp.status == 200:
                        return time.monotonic() - self._started_at
            except OSError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"tritonserver not ready in {timeout:.0f}s; {self.log_path}:\n{self.log_tail()}")

    @property
    def pid(self) -> int:
        assert self._proc is not None, "not started"
        return self._proc.pid

    def poll(self) -> int | None:
        """Its exit code, None while it runs."""
        assert self._proc is not None, "not started"
        return self._proc.poll()

    def kill(self) -> None:
        """SIGKILL the server and its stubs (its process group) at once; stop() still cleans up."""
        assert self._proc is not None, "not started"
        if self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait()

    def stop(self) -> None:
        """SIGTERM (graceful), then SIGKILL to what is left of its process group (all of it if that hangs),
        then drop leftover shm regions."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(self.exit_timeout_s + 15)
            except subprocess.TimeoutExpired:
                pass
        # Its stubs too: a stub outlives a server that crashed (seen: llm's, still generating for the dead
        # server's streams 5 minutes later, with 2.6 GB and a third of a CPU).
        try:
            os.killpg(self._proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # nothing of the group left
        self._proc.wait()
        if self._pump:
            self._pump.join(timeout=5)
        for region in Path("/dev/shm").glob(f"{self.shm_prefix}*"):
            region.unlink(missing_ok=True)
        if self._own_workdir and self.workdir:  # keep only the log
            shutil.rmtree(self.workdir / "backends", ignore_errors=True)
            if not any(self.workdir.iterdir()):
                self.workdir.rmdir()
        self._proc = None

    def __enter__(self) -> TritonServer:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-repository", type=Path, default=Path("model_repository"))
    parser.add_argument("--http-port", type=int, default=8000, help="0 for any free port (also below)")
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument("--host", default=LOOPBACK,
                        help="the IPv4 address the three ports listen on; 0.0.0.0: every interface")
    parser.add_argument("--open-admin-apis", action="store_true",
                        help=f"let any client use Triton's admin APIs ({', '.join(ADMIN_APIS)}); by "
                             f"default only one sending the header `{ADMIN_HEADER}: ${ADMIN_KEY_ENV}` (none if "
                             "it is unset)")
    parser.add_argument("--log-verbose", type=int, default=0)
    parser.add_argument("--log-file", type=Path, help="default: tritonserver.log in a temporary dir")
    parser.add_argument("--ready-timeout", type=float, default=300.0)
    parser.add_argument("--max-restarts", type=int, default=5,
                        help="restart a tritonserver that exits by itself, after 1, 2, 4 .. 30 s; the count starts "
                             "again after 10 minutes up; -1: always, 0: never")
    parser.add_argument("--stall-timeout", type=float, default=30.0,
                        help="restart a tritonserver whose engine loop has made no progress for this long (a step "
                             "running longer, or work waiting that no step takes, counts as wedged), or whose gRPC "
                             "door left a new stream unanswered this long, or whose python backend stub died; "
                             "0: only the last")
    parser.add_argument("--auto-complete-config", action="store_true",
                        help="let Triton complete configs (it then loads each python model twice; ours are complete)")
    args = parser.parse_args(argv[:split])
    extra = argv[split + 1:] + ([] if args.auto_complete_config else ["--disable-auto-complete-config"])
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    # SIGTERM stops it as Ctrl-C does; SIGINT is set too, since a background job of a script starts with it
    # ignored, and Python then leaves it so (seen: the CLI tests under `bash -c '.ci/run' &`)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupt)
    server = TritonServer(args.model_repository, args.http_port, args.grpc_port, args.metrics_port,
                          args.log_verbose, extra, log_path=args.log_file, echo=True, host=args.host,
                          admin_key=None if args.open_admin_apis else admin_key_from_env())
    if server.admin_key is None:
        admin = "Admin APIs: open to every client (--open-admin-apis).\n"
    elif os.environ.get(ADMIN_KEY_ENV):
        admin = f"Admin APIs ({', '.join(ADMIN_APIS)}): send the header `{ADMIN_HEADER}: ${ADMIN_KEY_ENV}`.\n"
    else:
        admin = f"Admin APIs ({', '.join(ADMIN_APIS)}): closed, {ADMIN_KEY_ENV} is unset.\n"
    # the llm's CPU kernels, built here with a progress line if this CPU has none, not inside the server's model load
    subprocess.run([sys.executable, "-m", "backend.engine.kernels.cpu_kernels"], check=False)
    try:
        restarts = 0
        while True:
            server.start()
            elapsed = server.wait_ready(args.ready_timeout)
            if restarts == 0:
                print(f"\ntritonserver ready in {elapsed:.1f}s, log in {server.log_path}. Try:\n"
                      f"  python -m client \"Write a haiku about GPUs\" --stream    # gRPC on {server.url_grpc}\n"
                      f"  curl -sN {server.url_http}/v2/models/llm/generate_stream"
                      " -d '{\"text_input\": \"Write a haiku about GPUs\", \"max_tokens\": 64}'\n"
                      f"  curl -s {server.url_metrics} | head\n{admin}Ctrl-C to stop.", flush=True)
            else:
                print(f"tritonserver restarted, ready in {elapsed:.1f}s", file=sys.stderr, flush=True)
            up_since = time.monotonic()
            why = Supervisor(server, args.stall_timeout).wait()
            code = server.poll()
            tail = server.log_tail(15)
            server.stop()
            if time.monotonic() - up_since > STABLE_S:
                restarts = 0
            if 0 <= args.max_restarts <= restarts:
                print(f"{why}; not restarting it (--max-restarts {args.max_restarts}); its log ends:\n{tail}",
                      file=sys.stderr)
                return code or 1
            restarts += 1
            delay = min(30.0, 2.0 ** (restarts - 1))
            print(f"{why}; its log ends:\n{tail}\nrestarting it in {delay:.0f} s "
                  f"(restart {restarts}{'' if args.max_restarts < 0 else f' of {args.max_restarts}'})",
                  file=sys.stderr, flush=True)
            time.sleep(delay)
    except KeyboardInterrupt:
        return 0
    except (RuntimeError, TimeoutError) as err:  # no server, or it died or hung while loading models
        print(err, file=sys.stderr)
        return 1
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
