"""Draw the Grafana dashboard (monitoring/grafana/llm-dashboard.json) from Prometheus data, without Grafana.

Every panel's queries come from the dashboard JSON (Grafana's `$__rate_interval`, `$__range` and `$model`
made concrete); each panel is drawn in its gridPos as a matplotlib axes, into one PNG.

    python -m load_tests.render_dashboard --prometheus http://127.0.0.1:9090 [--minutes 15] [--end UNIX_TIME]
        [--model llm] [--rate-interval 20s] [--out docs/dashboard.png]
"""

from __future__ import annotations

import argparse
import json
import math
import re
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Iterator

REPO = Path(__file__).resolve().parents[1]
DASHBOARD = REPO / "monitoring" / "grafana" / "llm-dashboard.json"
GRID_COLUMNS = 24  # Grafana's grid width
COLORS = {"green": "#56a64b", "orange": "#ff9830", "red": "#e02f44", "blue": "#3274d9"}
_LEGEND_LABEL = re.compile(r"\{\{\s*(\w+)\s*\}\}")


def load_dashboard(path: Path = DASHBOARD) -> dict[str, Any]:
    return json.loads(path.read_text())


def targets(dashboard: dict[str, Any]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(panel, target) for every query of the dashboard."""
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            yield panel, target


@dataclass(frozen=True)
class Window:
    """What Grafana would fill in: the time range, the step and the rate window of its queries, the model."""

    start: float
    end: float
    step: float = 1.0
    rate_interval: str = "20s"  # Grafana's $__rate_interval: at least 4 scrape intervals
    model: str = "llm"

    def concrete(self, expr: str) -> str:
        """`expr` with Grafana's variables replaced by this window's values."""
        values = {"__rate_interval": self.rate_interval, "__interval": f"{self.step:g}s",
                  "__range": f"{max(1, round(self.end - self.start))}s", "model": self.model}
        return re.sub(r"\$\{?(\w+)\}?", lambda m: values[m.group(1)], expr)


@dataclass(frozen=True)
class Series:
    label: str
    times: list[float]
    values: list[float]


@dataclass(frozen=True)
class Prometheus:
    """Prometheus' HTTP API (/api/v1/...)."""

    url: str

    def get(self, path: str, timeout: float = 10.0, **params: object) -> Any:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=timeout) as resp:
            body = json.load(resp)
        if body["status"] != "success":
            raise RuntimeError(f"{path} {params}: {body}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """An instant query's series (vector result)."""
        return self.get("query", query=expr, **({"time": at} if at is not None else {}))["result"]

    def query_range(self, expr: str, window: Window) -> list[dict[str, Any]]:
        """A range query's series (matrix result), `expr` made concrete for `window`."""
        return self.get("query_range", query=window.concrete(expr), start=window.start, end=window.end,
                        step=window.step)["result"]


def legend(fmt: str, metric: dict[str, str]) -> str:
    """Grafana's legendFormat: `{{label}}` replaced by the series' label value."""
    return _LEGEND_LABEL.sub(lambda m: metric.get(m.group(1), ""), fmt) if fmt else str(metric or "value")


def panel_series(prom: Prometheus, panel: dict[str, Any], window: Window) -> list[Series]:
    return [Series(legend(target.get("legendFormat", ""), result["metric"]),
                   [float(t) for t, _ in result["values"]], [float(v) for _, v in result["values"]])
            for target in panel["targets"] for result in prom.query_range(target["expr"], window)]


def format_value(value: float, unit: str, decimals: int | None = None) -> str:
    """A value in one of the dashboard's Grafana units."""
    if math.isnan(value):
        return "no data"
    if decimals is not None:
        return f"{value:.{decimals}f}"
    if unit == "percentunit":
        return f"{value:.0%}"
    if unit == "s":
        return f"{value * 1000:.3g} ms" if abs(value) < 1 else f"{value:.3g} s"
    if unit == "reqps":
        return f"{value:.3g} req/s"
    scale, suffix = next(((10**e, p) for e, p in ((9, " G"), (6, " M"), (3, " K")) if abs(value) >= 10**e),
                         (1, ""))
    return f"{value / scale:.3g}{suffix}"


def threshold_color(defaults: dict[str, Any], value: float) -> str:
    """The color of the last threshold step at or below `value` (Grafana's absolute thresholds)."""
    color = "blue"
    for step in defaults.get("thresholds", {}).get("steps", []):
        if step["value"] is None or value >= step["value"]:
            color = step["color"]
    return COLORS.get(color, color)


def _draw_timeseries(ax, panel: dict[str, Any], series: list[Series], unit: str, window: Window) -> None:
    import matplotlib.dates as mdates
    from matplotlib.ticker import FuncFormatter

    for s in series:
        ax.plot([datetime.fromtimestamp(t) for t in s.times], s.values, label=s.label, linewidth=1.2)
    ax.set_xlim(datetime.fromtimestamp(window.start), datetime.fromtimestamp(window.end))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: format_value(v, unit)))
    ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S"))
    ax.set_ylabel(panel["fieldConfig"]["defaults"].get("custom", {}).get("axisLabel", ""), fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)
    ax.set_ylim(bottom=0)
    if series:
        ax.legend(fontsize=7, loc="best", ncol=2, framealpha=0.7)


def _draw_single_value(ax, panel: dict[str, Any], series: list[Series], unit: str, window: Window) -> None:
    """stat: the last value, colored by threshold, over a faint sparkline; gauge: a bar from min to max."""
    defaults = panel["fieldConfig"]["defaults"]
    values = [v for s in series[:1] for v in s.values if not math.isnan(v)]
    value = values[-1] if values else math.nan
    color = threshold_color(defaults, value) if values else "grey"
    ax.set_axis_off()
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.text(0.5, 0.55, format_value(value, unit, defaults.get("decimals")), ha="center", va="center",
            fontsize=20, color=color, weight="bold")
    if panel["type"] == "gauge" and values:
        low, high = defaults.get("min", 0), defaults.get("max", 1)
        ax.barh(0.15, 1, height=0.12, left=0, color="#e6e6e6")
        ax.barh(0.15, min(1.0, max(0.0, (value - low) / (high - low))), height=0.12, left=0, color=color)
    elif len(values) > 1:
        top = max(values) or 1
        ax.fill_between([i / (len(values) - 1) for i in range(len(values))],
                        [0.05 + 0.25 * v / top for v in values], 0.05, color=color, alpha=0.25)


def render(prom: Prometheus, window: Window, out: Path, dashboard: dict[str, Any] | None = None) -> Path:
    """Every panel of `dashboard` at its gridPos, from `prom`'s data over `window`, saved as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dashboard = dashboard or load_dashboard()
    panels = dashboard["panels"]
    column, row, header = 0.85, 0.36, 0.6  # inches: a grid column, a grid row, the title above the grid
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    width, height = GRID_COLUMNS * column, rows * row + header
    fig = plt.figure(figsize=(width, height))
    start, end = datetime.fromtimestamp(window.start), datetime.fromtimestamp(window.end)
    span = f"{start:%Y-%m-%d %H:%M:%S} to {end:%H:%M:%S}"
    fig.text(0.01, 1 - 0.3 / height, f"{dashboard['title']}   ({span}, model {window.model})",
             fontsize=14, weight="bold", va="center")
    for panel in panels:
        pos, unit = panel["gridPos"], panel["fieldConfig"]["defaults"].get("unit", "short")
        timeseries = panel["type"] == "timeseries"
        left, right, top, bottom = (0.75, 0.15, 0.4, 0.35) if timeseries else (0.1, 0.1, 0.4, 0.05)
        x0, y0 = pos["x"] * column + left, height - header - (pos["y"] + pos["h"]) * row + bottom
        ax = fig.add_axes((x0 / width, y0 / height, (pos["w"] * column - left - right) / width,
                           (pos["h"] * row - top - bottom) / height))
        ax.set_title(panel["title"], fontsize=10, weight="bold", loc="left")
        draw = _draw_timeseries if timeseries else _draw_single_value
        draw(ax, panel, panel_series(prom, panel, window), unit, window)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prometheus", default="http://127.0.0.1:9090", help="Prometheus' base URL")
    parser.add_argument("--minutes", type=float, default=15.0, help="the time range, ending at --end")
    parser.add_argument("--end", type=float, default=None, help="Unix time the range ends (default: now)")
    parser.add_argument("--model", default="llm", help="the dashboard's $model")
    parser.add_argument("--rate-interval", default="20s", help="$__rate_interval (4+ scrape intervals)")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "dashboard.png")
    args = parser.parse_args(argv)
    end = args.end or time.time()
    start = end - args.minutes * 60
    window = Window(start, end, step=max(1.0, (end - start) / 400), rate_interval=args.rate_interval,
                    model=args.model)
    print(render(Prometheus(args.prometheus.rstrip("/")), window, args.out))


if __name__ == "__main__":
    main()
