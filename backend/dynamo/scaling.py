"""Workers added and stopped as Dynamo's planner decides (`serve-dynamo --planner`).

The planner (planner.py) runs in its load mode on the workers' forward-pass metrics and publishes each decision
through its virtual connector; scaler.py relays them here, where the worker processes are. Its `agg` mode for
aggregated workers (KV use), its `disagg` mode for prefill and decode workers apart (a prefill worker's queued prompt
tokens, a decode worker's KV use). For each decision: each role's worker count held to [min_workers, max_workers];
workers started (Cluster.add_worker returns once the frontend routes to the new one) or the role's newest stopped
gracefully (SIGTERM: Dynamo's graceful shutdown unregisters it, then its streams in flight finish: none is cut; a
prefill worker then waits for its last exports to be fetched); then the decision is acknowledged, and the planner
decides again. Each decision is logged (decisions.log in the cluster's log folder, and `Autoscaler.decisions`); the
metrics behind it are in the planner's own log (planner.log: `Easy agg ... util=`, `Load prefill ... queued=`,
`[summary] SCALE_UP`).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from backend.dynamo.launcher import Cluster


@dataclass
class Decision:
    at: float  # time.time() when applied
    decision_id: int
    wanted: dict[str, int]  # role -> the count the planner asked for (-1: not set)
    serving: dict[str, int]  # role -> workers serving after it was applied
    error: str = ""  # a worker that did not start, if one did not

    @property
    def workers(self) -> int:
        return sum(self.serving.values())


def planner_config(load: dict, model_name: str, min_workers: int, max_workers: int, disagg: bool = False) -> dict:
    """dynamo.planner's config in load mode: `load` (its thresholds: decode_scale_up_kv_rate,
    decode_scale_down_kv_rate, and disaggregated prefill_scale_up_queue_tokens, prefill_scale_down_queue_tokens;
    load_adjustment_interval_seconds) over these defaults. A worker counts as one "GPU" of the planner's budget, so
    max_gpu_budget is the most workers (of each role)."""
    roles = {"mode": "disagg", "prefill_engine_num_gpu": 1} if disagg else {"mode": "agg"}
    return {"environment": "virtual", "backend": "vllm", **roles, "optimization_target": "load",
            "enable_load_scaling": True, "enable_throughput_scaling": False, "pre_deployment_sweeping_mode": "none",
            "decode_engine_num_gpu": 1, **load, "model_name": model_name, "min_endpoint": min_workers,
            "max_gpu_budget": max_workers * (2 if disagg else 1)}


@dataclass
class Autoscaler:
    cluster: Cluster
    load: dict  # the planner's load-mode settings (planner_config)
    min_workers: int = 1
    max_workers: int = 2
    check_interval_s: int = 1  # how often the planner checks that a decision was carried out
    decisions: list[Decision] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.disagg = "prefill" in self.cluster.roles
        config = planner_config(self.load, self.cluster.served_model_name, self.min_workers, self.max_workers,
                                self.disagg)
        self.planner = self.cluster.start_planner(config, SCALING_CHECK_INTERVAL=str(self.check_interval_s))
        self.scaler = self.cluster.start_beside("scaler", ["backend.dynamo.scaler"], pipe=True)
        self._thread = threading.Thread(target=self._follow, name="autoscaler", daemon=True)
        self._thread.start()

    def serving(self, role: str | None = None) -> list[int]:
        """The workers running (of `role`, else all) that the autoscaler has not stopped."""
        return [i for i, p in enumerate(self.cluster.workers) if p.poll() is None and i not in self.cluster.stopped
                and role in (None, self.cluster.roles[i])]

    def _follow(self) -> None:
        log = (self.cluster.log_dir / "decisions.log").open("a")
        for line in self.scaler.stdout:
            message, error = json.loads(line), ""
            # aggregated: every worker prefills and decodes, and the planner counts them as decode workers
            wanted = ({"prefill": message["prefill"], "decode": message["decode"]} if self.disagg
                      else {"both": message["decode"]})
            try:
                for role, target in wanted.items():
                    if target < 0:
                        continue
                    target = min(max(target, self.min_workers), self.max_workers)
                    while len(self.serving(role)) < target:
                        self.cluster.add_worker(role)
                    while len(self.serving(role)) > target:
                        self.cluster.stop_worker(self.serving(role)[-1], graceful=True)
            except (RuntimeError, TimeoutError) as err:  # a worker that died starting, or never joined
                error = str(err).splitlines()[0]
            decision = Decision(time.time(), message["decision_id"], wanted,
                                {role: len(self.serving(role)) for role in wanted}, error)
            self.decisions.append(decision)
            log.write(json.dumps(decision.__dict__) + "\n")
            log.flush()
            self.scaler.stdin.write("done\n")
            self.scaler.stdin.flush()
