"""The Grafana dashboard (monitoring/grafana/llm-dashboard.json): the schema fields Grafana needs (no Grafana
server here), its compose wiring, and every query it makes answered by a real Prometheus (Debian's package,
installed by `make test` through scripts/prometheus_env.sh) scraping the test tritonserver under load.
"""

from __future__ import annotations

import itertools
import math
import subprocess
import time
import urllib.parse
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml
from tritonclient.utils import InferenceServerException

from backend.triton.launcher import free_ports
from client.client import LLMClient
from load_tests.render_dashboard import GRID_COLUMNS, Prometheus, Window, load_dashboard, render, targets

REPO = Path(__file__).resolve().parents[1]
MONITORING = REPO / "monitoring"
PROMETHEUS = Path("/usr/bin/prometheus")
PROMTOOL = Path("/usr/bin/promtool")
DASHBOARD = load_dashboard()
PANELS = DASHBOARD["panels"]
DATASOURCE = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
SYSTEM_PROMPT = "You are a terse assistant. Answer in one short sentence, and never apologise. "


def _require(program: Path) -> None:
    assert program.is_file(), f"no {program}: `make test` installs it (scripts/prometheus_env.sh)"


def test_dashboard_top_level():
    assert {"title", "uid", "schemaVersion", "panels", "templating", "time", "refresh"} <= DASHBOARD.keys()
    assert DASHBOARD["schemaVersion"] >= 36 and DASHBOARD["uid"] and DASHBOARD["title"]
    assert DASHBOARD["time"] == {"from": "now-15m", "to": "now"}
    variables = {v["name"]: v for v in DASHBOARD["templating"]["list"]}
    datasource = variables["DS_PROMETHEUS"]
    assert datasource["type"] == "datasource" and datasource["query"] == "prometheus"
    assert variables["model"]["datasource"] == DATASOURCE
    assert "llm_" in variables["model"]["definition"]
    ids = [panel["id"] for panel in PANELS]
    assert len(ids) == len(set(ids)), "panel ids are unique"


@pytest.mark.parametrize("panel", PANELS, ids=lambda panel: panel["title"])
def test_panel_schema(panel):
    assert {"id", "type", "title", "gridPos", "targets", "datasource", "fieldConfig"} <= panel.keys()
    assert panel["type"] in ("timeseries", "stat", "gauge") and panel["title"]
    pos = panel["gridPos"]
    assert all(isinstance(pos[k], int) for k in "xywh") and pos["x"] >= 0 and pos["y"] >= 0
    assert pos["w"] > 0 and pos["h"] > 0 and pos["x"] + pos["w"] <= GRID_COLUMNS
    assert panel["datasource"] == DATASOURCE
    refs = [target["refId"] for target in panel["targets"]]
    assert refs and len(refs) == len(set(refs)), "each query has its own refId"
    for target in panel["targets"]:
        assert target["expr"].strip() and target["datasource"] == DATASOURCE


def test_panels_do_not_overlap():
    cells = {}
    for panel in PANELS:
        pos = panel["gridPos"]
        columns, rows = range(pos["x"], pos["x"] + pos["w"]), range(pos["y"], pos["y"] + pos["h"])
        for cell in itertools.product(columns, rows):
            assert cell not in cells, f"{panel['title']!r} overlaps {cells[cell]!r} at {cell}"
            cells[cell] = panel["title"]


def test_monitoring_compose_services():
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]
    prometheus, grafana = compose["prometheus"], compose["grafana"]
    assert prometheus["profiles"] == grafana["profiles"] == ["monitoring"]

    def mounts(service: dict) -> dict[str, Path]:
        """container path -> file or folder of this checkout"""
        return {target: REPO / source for source, target, *_ in (v.split(":") for v in service["volumes"])
                if source.startswith("./")}

    config = next(arg.split("=", 1)[1] for arg in prometheus["command"] if arg.startswith("--config.file="))
    assert mounts(prometheus)[config] == MONITORING / "prometheus.yml"
    listen = next(arg for arg in prometheus["command"] if arg.startswith("--web.listen-address="))
    grafana_mounts = mounts(grafana)
    datasources = grafana_mounts["/etc/grafana/provisioning/datasources"] / "prometheus.yml"
    (source,) = yaml.safe_load(datasources.read_text())["datasources"]
    assert source["type"] == "prometheus" and source["url"].endswith(":" + listen.rsplit(":", 1)[1])
    (provider,) = yaml.safe_load((grafana_mounts["/etc/grafana/provisioning/dashboards"] / "llm.yml")
                                 .read_text())["providers"]
    dashboard = MONITORING / "grafana" / "llm-dashboard.json"
    assert grafana_mounts[f"{provider['options']['path']}/{dashboard.name}"] == dashboard
    # host networking: both reach triton's metrics where it is published, 127.0.0.1:8002
    assert prometheus["network_mode"] == grafana["network_mode"] == "host"


def test_prometheus_config_is_valid():
    _require(PROMTOOL)
    out = subprocess.run([str(PROMTOOL), "check", "config", str(MONITORING / "prometheus.yml")],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


@contextmanager
def run_prometheus(scrape_targets: list[str], workdir: Path, interval: str = "1s") -> Iterator[Prometheus]:
    """Prometheus on 127.0.0.1 (a free port) with monitoring/prometheus.yml scraping `scrape_targets`."""
    _require(PROMETHEUS)
    config = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    config["global"].update(scrape_interval=interval, evaluation_interval=interval)
    for job in config["scrape_configs"]:
        job["static_configs"] = [{"targets": scrape_targets}]
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
    (port,) = free_ports(1)
    with open(workdir / "prometheus.log", "wb") as log:
        proc = subprocess.Popen([str(PROMETHEUS), f"--config.file={workdir / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={workdir / 'data'}",
                                 f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=log, stderr=subprocess.STDOUT)
        try:
            prom = Prometheus(f"http://127.0.0.1:{port}")
            deadline = time.monotonic() + 60
            while not _scraped(prom):
                assert proc.poll() is None and time.monotonic() < deadline, \
                    (workdir / "prometheus.log").read_text()
                time.sleep(0.2)
            yield prom
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _scraped(prom: Prometheus) -> bool:
    """Ready (its API answers 503 before), and a first scrape of a target went well."""
    try:
        return bool(prom.query("up == 1"))
    except OSError:  # connection refused, or HTTP 503
        return False


def put_load(url_grpc: str, seconds: float, streams: int = 4) -> int:
    """`streams` clients sending requests back to back for `seconds` (a shared system prompt, so the prefix
    cache hits), and one invalid request (refused as "invalid"). Returns the requests that finished."""
    with LLMClient(url_grpc, "llm") as client, pytest.raises(InferenceServerException, match="top_p"):
        client.generate("refused", max_tokens=8, top_p=5.0)
    deadline = time.monotonic() + seconds

    def stream(i: int) -> int:
        with LLMClient(url_grpc, "llm") as client:
            for n in itertools.count():
                if time.monotonic() >= deadline:
                    return n
                client.generate(f"{SYSTEM_PROMPT}Question {i}.{n}: what is {n} + {i}?", max_tokens=8)

    with ThreadPoolExecutor(streams) as pool:
        return sum(pool.map(stream, range(streams)))


@pytest.fixture(scope="module")
def scraped(server, tmp_path_factory) -> Iterator[tuple[Prometheus, Window]]:
    """A Prometheus that scraped `server` (1 s interval) through ~10 s of load; the window over it."""
    target = urllib.parse.urlsplit(server.url_metrics).netloc
    with run_prometheus([target], tmp_path_factory.mktemp("prometheus")) as prom:
        start = time.time()
        assert put_load(server.url_grpc, 10.0) > 0
        time.sleep(2.5)  # the last scrapes
        yield prom, Window(start - 5, time.time(), step=1.0, rate_interval="15s", model="llm")


def test_every_dashboard_query_returns_data(scraped):
    """Every panel query, with Grafana's variables made concrete: an instant query answers with series, and a
    range query over the load with a number (not NaN) somewhere."""
    prom, window = scraped
    empty = []
    for panel, target in targets(DASHBOARD):
        expr = window.concrete(target["expr"])
        assert "$" not in expr, f"a Grafana variable is left in {expr}"
        series = prom.query_range(target["expr"], window)
        values = [float(v) for one in series for _, v in one["values"]]
        if not prom.query(expr, at=window.end) or not any(math.isfinite(v) for v in values):
            empty.append(f"{panel['title']} / {target['refId']}: {expr}")
    assert not empty, "queries without data:\n" + "\n".join(empty)


def test_render_dashboard_png(scraped, tmp_path):
    import matplotlib.image

    prom, window = scraped
    image = matplotlib.image.imread(render(prom, window, tmp_path / "dashboard.png"))
    height, width = image.shape[:2]
    assert width > 1000 and height > 1000
