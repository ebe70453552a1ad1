"""Static checks of docker-compose.yml and the Dockerfile: no Docker engine runs on the dev machines.

They check the wiring (prepare writes the repository and engine into the `models` volume, triton serves
them from there), the settings the Triton pitfalls call for, and that every file, module and command line
the two files use exists and parses against this code's own argparse.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import runpy
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path, PurePosixPath

import pytest
import yaml

import backend.triton.launcher
from backend.dynamo.args import worker_parser

REPO = Path(__file__).resolve().parents[1]
DYNAMO_PYTHON = REPO / ".venv-dynamo" / "bin" / "python"
# Files that other work in progress is writing: a check that needs a missing one is skipped, naming it.
PENDING = {"load_tests/locustfile.py", "build_engine/__main__.py"}

_COMPOSE_VAR = re.compile(r"\$\$|\$\{(\w+)(?::?-([^}]*))?\}")


def _interpolate(node):
    """Compose's variable substitution with nothing set: `${VAR:-default}` -> default, `$$` -> `$`."""
    if isinstance(node, str):
        return _COMPOSE_VAR.sub(lambda m: "$" if m.group(0) == "$$" else (m.group(2) or ""), node)
    if isinstance(node, list):
        return [_interpolate(item) for item in node]
    if isinstance(node, dict):
        return {key: _interpolate(value) for key, value in node.items()}
    return node


RAW_SERVICES = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]  # `${VAR:-default}` kept
COMPOSE = _interpolate(yaml.safe_load((REPO / "docker-compose.yml").read_text()))
SERVICES = COMPOSE["services"]


def _dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", (REPO / "Dockerfile").read_text())
    lines = (line.strip() for line in text.splitlines())
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines
            if line and not line.startswith("#")]


DOCKERFILE = _dockerfile()
DOCKER_ARGS = dict(arg.split("=", 1) for instr, arg in DOCKERFILE if instr == "ARG" and "=" in arg)
DOCKER_RUN = "\n".join(arg for instr, arg in DOCKERFILE if instr == "RUN")
DOCKER_COPIED = {src for instr, args in DOCKERFILE if instr == "COPY"
                 for src in [word for word in args.split() if not word.startswith("--")][:-1]}


def _mount(service: str, volume: str = "models") -> tuple[PurePosixPath, bool]:
    """(container path, writable) of a named volume in a service (short syntax)."""
    for spec in SERVICES[service].get("volumes", []):
        source, target, *mode = spec.split(":")
        if source == volume:
            return PurePosixPath(target), mode != ["ro"]
    pytest.fail(f"{service} does not mount the {volume!r} volume")


def _prepare_script() -> str:
    shell, flags, script = SERVICES["prepare"]["command"]
    assert shell == "bash" and "e" in flags and flags.endswith("c"), "prepare must run a bash -e script"
    # The shell's own variables: the service environment (Dockerfile ENV is not used by the script).
    env = SERVICES["prepare"]["environment"]
    return re.sub(r"\$\{?(\w+)\}?", lambda m: env[m.group(1)], script.replace("\\\n", " "))


def _module_args(command: list[str], module: str) -> list[str]:
    """The arguments after `python3 -m MODULE` in an exec-form command."""
    for i in range(len(command) - 1):
        if command[i] == "-m" and command[i + 1] == module:
            return command[i + 2:]
    pytest.fail(f"{command} does not run -m {module}")


def _build_engine_args() -> list[str]:
    calls = [line for line in _prepare_script().splitlines() if re.search(r"-m build_engine(\s|$)", line)]
    assert len(calls) == 1, "prepare runs `python3 -m build_engine` on one line"
    return _module_args(shlex.split(calls[0]), "build_engine")


def _option(args: list[str], flag: str) -> str:
    assert flag in args, f"{flag} missing from {shlex.join(args)}"
    return args[args.index(flag) + 1]


def _triton_command() -> list[str]:
    return _module_args(SERVICES["triton"]["command"], "backend.triton.launcher")


def _require(relpath: str, present: bool) -> None:
    if not present:
        if relpath in PENDING:
            pytest.skip(f"{relpath} does not exist yet (written separately)")
        pytest.fail(f"{relpath} is referenced but missing")


class _Parsed(BaseException):  # not an Exception: a CLI's own `except Exception` must not catch it
    def __init__(self, namespace: argparse.Namespace):
        self.namespace = namespace


def _parse_cli(run: Callable[[], object], command_line: str, monkeypatch, capsys) -> argparse.Namespace:
    """Call a CLI up to its first parse_args and stop there: the flags must parse, nothing else runs."""
    real_parse = argparse.ArgumentParser.parse_args

    def parse_and_stop(self, *args, **kwargs):
        raise _Parsed(real_parse(self, *args, **kwargs))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_and_stop)
    try:
        run()
    except _Parsed as parsed:
        return parsed.namespace
    except SystemExit as exit_:
        pytest.fail(f"`{command_line}` is rejected ({exit_.code}): {capsys.readouterr().err}")
    pytest.fail(f"`{command_line}` never parsed its arguments")


def _launcher_args(args: list[str], monkeypatch, capsys) -> argparse.Namespace:
    # main(argv), not runpy: backend.triton.launcher is already imported, and runpy warns about running it again.
    return _parse_cli(lambda: backend.triton.launcher.main(args), f"python3 -m backend.triton.launcher {shlex.join(args)}",
                      monkeypatch, capsys)


def _size(text: str) -> int:
    number, unit = re.fullmatch(r"(\d+)\s*([kmg]?)b?", str(text).lower()).groups()
    return int(number) * 1024 ** " kmg".index(unit or " ")


def test_services_and_volume():
    assert {"prepare", "triton", "locust-master", "locust-worker"} <= SERVICES.keys()
    assert "models" in COMPOSE["volumes"]


def test_triton_serves_what_prepare_writes():
    mount, writable = _mount("triton")
    repository = PurePosixPath(_option(_triton_command(), "--model-repository"))
    assert repository.is_relative_to(mount), f"{repository} is not in the models volume ({mount})"
    assert not writable, "triton only reads the volume"

    assert _mount("prepare") == (mount, True), "prepare mounts the same volume at the same path, writable"
    script, build = _prepare_script(), _build_engine_args()
    assert f"rm -rf {repository} " in script, "prepare starts from a fresh repository"
    assert f"python3 - {repository} " in script, "prepare writes the configured repository there"
    assert _option(build, "--llm-config") == str(repository / "llm" / "config.pbtxt")
    assert (REPO / "model_repository" / "llm" / "config.pbtxt").is_file()
    assert PurePosixPath(_option(build, "--output")).is_relative_to(mount)
    # The llm model resolves `model: default` through this path in both containers.
    env = dict(arg.split("=", 1) for instr, args in DOCKERFILE if instr == "ENV" for arg in args.split())
    assert PurePosixPath(env["LLM_MODEL_CACHE"]).is_relative_to(mount)


def test_triton_waits_for_prepare():
    assert SERVICES["triton"]["depends_on"]["prepare"]["condition"] == "service_completed_successfully"


def test_prepare_knobs():
    env, build = SERVICES["prepare"]["environment"], _build_engine_args()
    assert env["LLM_RUNTIME"] == _option(build, "--runtime") == "tensorrt"
    assert _option(build, "--dtype") == env["LLM_DTYPE"]


def test_prepare_script_is_valid_bash():
    result = subprocess.run(["bash", "-n", "-c", _prepare_script()], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_triton_container_settings(monkeypatch, capsys):
    triton = SERVICES["triton"]
    assert _size(triton["shm_size"]) >= 2**30, "python backend shm: Docker's 64 MB default is too small"
    published = {int(port.split(":")[-1]) for port in triton["ports"]}
    args = _launcher_args(_triton_command(), monkeypatch, capsys)
    assert published >= {args.http_port, args.grpc_port, args.metrics_port} == {8000, 8001, 8002}
    check = triton["healthcheck"]["test"]
    assert "curl" in check and f"http://localhost:{args.http_port}/v2/health/ready" in check
    assert triton["restart"] in ("always", "unless-stopped", "on-failure")


@pytest.mark.parametrize("service", ["prepare", "triton"])
def test_gpu_reservation(service):
    devices = SERVICES[service]["deploy"]["resources"]["reservations"]["devices"]
    assert {"driver": "nvidia", "count": 1, "capabilities": ["gpu"]} in devices


def test_locust_services():
    master, worker = SERVICES["locust-master"], SERVICES["locust-worker"]
    for service in (master, worker):
        assert "load" in service["profiles"]
        assert _option(service["command"], "-f") == "load_tests/locustfile.py"
    assert "--master" in master["command"] and "127.0.0.1:8089:8089" in master["ports"]
    assert "--worker" in worker["command"] and _option(worker["command"], "--master-host") == "locust-master"
    assert int(worker["deploy"]["replicas"]) >= 1


def _referenced_files() -> list[str]:
    locustfiles = [_option(SERVICES[name]["command"], "-f") for name in ("locust-master", "locust-worker")]
    contexts = {service["build"]["context"] for service in SERVICES.values() if "build" in service}
    return sorted({*DOCKER_COPIED, *locustfiles, *contexts, ".dockerignore", "scripts/dynamo_env.sh"})


@pytest.mark.parametrize("relpath", _referenced_files())
def test_referenced_file_exists(relpath):
    _require(relpath, (REPO / relpath).exists())


def _referenced_modules() -> list[tuple[str, bool]]:
    """(module, run with -m): what the commands run, and what the prepare script imports from the project."""
    commands = [service["command"] for service in SERVICES.values()]
    commands += [yaml.safe_load(args) for instr, args in DOCKERFILE if instr == "CMD"]
    text = "\n".join(word for command in commands for word in command)
    # Dynamo's own modules live in .venv-dynamo: test_dynamo_frontend_command_parses checks them there
    run = {m for m in re.findall(r"(?<!\S)-m\s+([\w.]+)", text) if not m.startswith("dynamo.")}
    imported = {m for m in re.findall(r"from ([\w.]+) import", text)
                if m.split(".")[0] in ("backend", "build_engine")}
    return sorted({(m, True) for m in run} | {(m, False) for m in imported - run})


@pytest.mark.parametrize(("module", "run"), _referenced_modules())
def test_referenced_module_exists(module, run):
    path = module.replace(".", "/")
    spec = importlib.util.find_spec(module)
    _require(f"{path}.py", spec is not None)
    if run and spec.submodule_search_locations:  # `python -m package` runs package/__main__.py
        _require(f"{path}/__main__.py", importlib.util.find_spec(f"{module}.__main__") is not None)


def test_build_engine_accepts_prepare_command(monkeypatch, capsys):
    _require("build_engine/__main__.py", (REPO / "build_engine" / "__main__.py").is_file())
    args = _build_engine_args()
    monkeypatch.setattr(sys, "argv", ["build_engine", *args])
    _parse_cli(lambda: runpy.run_module("build_engine", run_name="__main__", alter_sys=True),
               f"python3 -m build_engine {shlex.join(args)}", monkeypatch, capsys)


def test_dockerfile_cmd_is_the_triton_command(monkeypatch, capsys):
    (cmd,) = [yaml.safe_load(args) for instr, args in DOCKERFILE if instr == "CMD"]
    args = _launcher_args(_module_args(cmd, "backend.triton.launcher"), monkeypatch, capsys)
    assert str(args.model_repository) == _option(_triton_command(), "--model-repository")
    assert args.host == "0.0.0.0", "`docker run -p` reaches only a server on the container's every interface"


def test_dockerfile_base_image_and_installs():
    (base,) = [args for instr, args in DOCKERFILE if instr == "FROM"]
    base = re.sub(r"\$\{(\w+)\}", lambda m: DOCKER_ARGS[m.group(1)], base)
    assert re.fullmatch(r"nvcr\.io/nvidia/tritonserver:\d\d\.\d\d-py3", base), base
    assert SERVICES["triton"]["build"]["args"]["TRITON_TAG"] == DOCKER_ARGS["TRITON_TAG"]
    for requirements in ("requirements.txt", "requirements-nodeps.txt"):
        assert requirements in DOCKER_COPIED and (REPO / requirements).is_file()
        assert f"-r /tmp/{requirements}" in DOCKER_RUN, f"{requirements} is not installed"
    assert "--no-deps -r /tmp/requirements-nodeps.txt" in DOCKER_RUN
    # torch: the pin of requirements.txt, from the CUDA index given as a build arg
    assert "\"$(grep -E '^torch==' requirements.txt)\" --index-url \"$TORCH_INDEX_URL\"" in DOCKER_RUN
    assert DOCKER_ARGS["TORCH_INDEX_URL"].startswith("https://download.pytorch.org/whl/cu")
    assert "pip install --no-deps -e ." in DOCKER_RUN, "the stub imports backend/ from the installed project"
    # the programs compose runs besides python3 and bash
    assert re.search(r"apt-get install .*\bcurl\b", DOCKER_RUN)
    assert DOCKER_ARGS["LOCUST_PACKAGE"].startswith("locust==")


def test_dockerignore_keeps_local_state_out():
    patterns = set((REPO / ".dockerignore").read_text().split())
    assert {".git", ".env", ".venv*", ".cache", "results", "**/__pycache__"} <= patterns  # .env: secrets


DYNAMO_SERVICES = ("etcd", "nats", "dynamo-frontend", "dynamo-worker")


def test_dynamo_profile_wiring():
    frontend, worker = SERVICES["dynamo-frontend"], SERVICES["dynamo-worker"]
    assert all(SERVICES[name]["profiles"] == ["dynamo"] for name in DYNAMO_SERVICES)
    env = {"ETCD_ENDPOINTS": "http://etcd:2379", "NATS_SERVER": "nats://nats:4222"}
    assert env.items() <= frontend["environment"].items() and env.items() <= worker["environment"].items()
    assert "--listen-client-urls" in SERVICES["etcd"]["command"] and "-js" in SERVICES["nats"]["command"]
    assert "127.0.0.1:8080:8080" in frontend["ports"]
    assert frontend["depends_on"]["prepare"]["condition"] == "service_completed_successfully"
    # the frontend reads the tokenizer from the model folder the workers register: the same volume, same path
    assert _mount("dynamo-frontend") == _mount("dynamo-worker") == (_mount("prepare")[0], False)
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert {"driver": "nvidia", "count": 1, "capabilities": ["gpu"]} in devices
    assert int(worker["deploy"]["replicas"]) >= 1
    for service in (frontend, worker):
        assert service["command"][0] == "/opt/dynamo/bin/python"
    assert "DYNAMO_VENV=/opt/dynamo DYNAMO_SYSTEM_SITE=1 PY=python3 bash scripts/dynamo_env.sh" in DOCKER_RUN


def test_dynamo_worker_command_parses_and_serves_what_prepare_built():
    args = worker_parser().parse_args(_module_args(SERVICES["dynamo-worker"]["command"], "backend.dynamo.worker"))
    assert (args.discovery_backend, args.event_plane) == ("etcd", "nats")
    build = _build_engine_args()
    assert args.runtime == _option(build, "--runtime") and args.dtype == _option(build, "--dtype")
    assert args.engine_dir == _option(build, "--output")


def test_dynamo_frontend_command_parses():
    """With Dynamo's own parser, in .venv-dynamo (`make dynamo-venv`; make test builds it)."""
    assert DYNAMO_PYTHON.exists(), "no .venv-dynamo: `make dynamo-venv`"
    args = _module_args(SERVICES["dynamo-frontend"]["command"], "dynamo.frontend")
    code = "from dynamo.frontend.main import parse_args; c = parse_args()[0]; print(c.router_mode, c.discovery_backend)"
    out = subprocess.run([str(DYNAMO_PYTHON), "-c", code, *args], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["kv", "etcd"]


def test_the_image_serves_as_a_user_without_root():
    users = [args for instr, args in DOCKERFILE if instr == "USER"]
    assert users and users[-1] not in ("root", "0"), "the image runs as root"
    last_user = max(i for i, (instr, _) in enumerate(DOCKERFILE) if instr == "USER")
    assert all(instr != "RUN" for instr, _ in DOCKERFILE[last_user:]), "a RUN after USER would run unprivileged"
    assert re.search(rf"useradd .*\b{users[-1]}\b", DOCKER_RUN) and "chown -R" in DOCKER_RUN
    mount, _ = _mount("prepare")
    assert f"{mount}" in DOCKER_RUN, "the models volume's directory belongs to the user"


def test_compose_publishes_only_the_serving_ports():
    published = {service: [int(p.split(":")[-1]) for p in spec.get("ports", [])] for service, spec in SERVICES.items()}
    assert {s: p for s, p in published.items() if p} == {
        "triton": [8000, 8001, 8002], "locust-master": [8089], "dynamo-frontend": [8080]}


def test_compose_publishes_on_the_host_loopback_by_default():
    specs = [spec for service in SERVICES.values() for spec in service.get("ports", [])]
    assert specs and all(re.fullmatch(r"127\.0\.0\.1:(\d+):\1", spec) for spec in specs), specs
    assert all(spec.startswith("${PUBLISH_HOST:-127.0.0.1}:") for service in RAW_SERVICES.values()
               for spec in service.get("ports", [])), "PUBLISH_HOST opens every published port"


def test_triton_listens_in_its_container_with_the_admin_apis_restricted(monkeypatch, capsys):
    args = _launcher_args(_triton_command(), monkeypatch, capsys)
    assert args.host == "0.0.0.0" and not args.open_admin_apis
    key = RAW_SERVICES["triton"]["environment"]["TRITON_ADMIN_KEY"]
    assert key == "${TRITON_ADMIN_KEY:-}", "the key comes from the shell"


def test_no_secret_is_written_in_compose():
    secret = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|PASSWD", re.IGNORECASE)
    for name, service in SERVICES.items():
        env = service.get("environment", {})
        assert isinstance(env, dict), f"{name}: environment as a mapping"
        assert all(value in ("", None) for var, value in env.items() if secret.search(var)), (name, env)
