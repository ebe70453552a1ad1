"""Dynamo's planner (ai-dynamo 1.6.1's `python -m dynamo.planner`) over this engine's workers, in its load mode.

    python -m backend.dynamo.planner --config '{"environment": "virtual", "mode": "agg",
        "optimization_target": "load", "model_name": "tiny", "decode_scale_up_kv_rate": 50, ...}'

Runs in .venv-dynamo, with the cluster's environment (launcher.start_planner). The load mode's decisions are
`dynamo/planner/core/load_scaling.py` on the forward-pass metrics our workers publish (publisher.py): KV use and
queued tokens against the thresholds; "Easy mode uses static thresholds -- no perf models needed"
(core/state_machine.py). The SLA mode needs AISimulate's performance model, `aisimulate_core`, which no package
index here has; the planner imports it at module level all the same (core/perf_model/ais_adapter.py: `from
aisimulate_core.sdk import ForwardPassPerfModelConfig`). So this puts planner_stub/ on the path (this process
only), where every name of aisimulate_core imports and any use of one raises ImportError, and it refuses
`optimization_target: sla` by name before the planner starts. A workaround for that one import, not a simulator.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

STUB = Path(__file__).resolve().parent / "planner_stub"
SLA_REFUSED = ("planner: optimization_target 'sla' needs AISimulate's performance model (aisimulate_core), which "
               "is not installable here; use 'load' (thresholds on the workers' forward-pass metrics), 'throughput' "
               "or 'latency'")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="JSON string or path to a JSON/YAML file (dynamo.planner's)")
    args = p.parse_args()
    sys.path.insert(0, str(STUB))
    from dynamo.planner.__main__ import worker
    from dynamo.planner.config.planner_config import PlannerConfig

    config = PlannerConfig.from_config_arg(args.config)
    if config.optimization_target == "sla":
        sys.exit(SLA_REFUSED)
    asyncio.run(worker(config))


if __name__ == "__main__":
    main()
