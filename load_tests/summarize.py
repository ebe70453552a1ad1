"""Summary table of a locust run of load_tests/locustfile.py, from locust's `--csv` stats file.

    python -m load_tests.summarize results/load/load_stats.csv

Percentiles are locust's (response times stored rounded: 1 ms under 100 ms, 10 ms under 1 s, ...).
Output tok/s in total = E2E requests/s x mean output tokens per request (the E2E rows' content size).
"""

from __future__ import annotations

import argparse
import csv
import sys
from dataclasses import dataclass, field
from pathlib import Path

METRICS = ("TTFT", "ITL", "E2E", "TOK/S")  # the locustfile's request types, in table order
PERCENTILES = ("50%", "90%", "99%")


@dataclass
class Row:
    kind: str  # request type: TTFT, ITL, E2E or TOK/S
    name: str  # "<protocol> <model>"
    count: int
    failures: int
    mean: float
    percentiles: dict[str, float]  # "50%" -> value (ms; tok/s for TOK/S)
    requests_per_s: float
    mean_content: float  # E2E: mean output tokens per request


@dataclass
class Summary:
    rows: list[Row]
    failures: list[tuple[str, int]] = field(default_factory=list)  # (message, occurrences)

    @property
    def errors(self) -> int:
        return sum(r.failures for r in self.rows)

    @property
    def output_tok_s(self) -> float:
        return sum(r.requests_per_s * r.mean_content for r in self.rows if r.kind == "E2E")

    def row(self, kind: str, name: str | None = None) -> Row:
        """The row of request type `kind` (for `name`, or the only one)."""
        found = [r for r in self.rows if r.kind == kind and name in (None, r.name)]
        if len(found) != 1:
            raise KeyError(f"{len(found)} rows of type {kind!r} named {name!r}")
        return found[0]


def _number(text: str) -> float:
    return float(text) if text not in ("", "N/A") else float("nan")


def read_summary(stats_csv: Path) -> Summary:
    """The locustfile's request types from `<prefix>_stats.csv`; failures from `<prefix>_failures.csv`."""
    with open(stats_csv, newline="") as f:
        rows = [Row(r["Type"], r["Name"], int(r["Request Count"]), int(r["Failure Count"]),
                    _number(r["Average Response Time"]), {p: _number(r[p]) for p in PERCENTILES},
                    _number(r["Requests/s"]), _number(r["Average Content Size"]))
                for r in csv.DictReader(f) if r["Type"] in METRICS]
    rows.sort(key=lambda r: (r.name, METRICS.index(r.kind)))
    failures_csv = Path(str(stats_csv).removesuffix("_stats.csv") + "_failures.csv")
    failures = []
    if failures_csv.exists():
        with open(failures_csv, newline="") as f:
            failures = [(f"{r['Method']} {r['Name']}: {r['Error']}", int(r["Occurrences"]))
                        for r in csv.DictReader(f)]
    return Summary(rows, failures)


def format_summary(summary: Summary) -> str:
    head = f"{'metric':<7} {'name':<24} {'count':>8} {'fails':>6} {'mean':>9} " + " ".join(
        f"{'p' + p.rstrip('%'):>9}" for p in PERCENTILES)
    lines = [head, "-" * len(head)]
    for r in summary.rows:
        unit = "tok/s" if r.kind == "TOK/S" else "ms"
        values = " ".join(f"{r.percentiles[p]:>9.0f}" for p in PERCENTILES)
        lines.append(f"{r.kind:<7} {r.name:<24} {r.count:>8} {r.failures:>6} {r.mean:>9.1f} {values}  {unit}")
    lines.append(f"output tok/s in total: {summary.output_tok_s:.1f}   errors: {summary.errors}")
    for message, count in sorted(summary.failures, key=lambda f: -f[1])[:5]:
        lines.append(f"  {count:>6} x {message}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stats_csv", type=Path, help="locust's <prefix>_stats.csv")
    args = p.parse_args(argv)
    summary = read_summary(args.stats_csv)
    if not summary.rows:
        print(f"{args.stats_csv}: no TTFT/ITL/E2E/TOK/S rows (did any request finish?)", file=sys.stderr)
        return 1
    print(format_summary(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
