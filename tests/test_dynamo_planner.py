"""Dynamo's planner (ai-dynamo 1.6.1, backend/dynamo/planner.py) scaling this engine's workers: the real
`dynamo.planner` in its load mode, on a real frontend, etcd, NATS and workers, reads the forward-pass metrics they
publish; under a load ramp (low, high, low) it adds a worker and later removes one, which the launcher carries out
(scaling.py: the virtual connector's decisions through scaler.py). Every request ends whole and greedy-equal to HF,
the removed worker drains and exits cleanly, the one left holds no KV block; the planner's own log is the evidence
of its decisions. The SLA mode is refused by name; the stand-in for `aisimulate_core` imports and refuses every use,
and the load mode never uses it."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time

import pytest
from openai import OpenAI

from backend.dynamo.planner import SLA_REFUSED, STUB
from backend.dynamo.scaling import Autoscaler
from backend.serving.tokenizer import load_tokenizer
from tests.dynamo_cluster import DYNAMO_PYTHON, MODEL, REPO, start_cluster, wait_kv_free, worker_metric
from tests.reference import hf_greedy

# the planner's load mode: scale up when a worker's KV (scheduled + queued) passes 30 % of its pool, down when every
# worker's is 0 (so none holds a block when one is stopped); decisions every second
LOAD = {"decode_scale_up_kv_rate": 30, "decode_scale_down_kv_rate": 0, "load_adjustment_interval_seconds": 1}
PROMPTS = [f"request {i} " * 30 for i in range(6)]
TOKENS = 120

def test_the_stand_in_imports_and_refuses_every_use():
    code = ("import aisimulate_core\n"
            "from aisimulate_core.sdk import ForwardPassPerfModelConfig\n"
            "from aisimulate_core._native import RustForwardPassPerfModel\n"
            "for use in (lambda: ForwardPassPerfModelConfig(isl=1), lambda: RustForwardPassPerfModel.load,\n"
            "            lambda: aisimulate_core.sdk.perf_database.get_database()):\n"
            "    try:\n"
            "        use()\n"
            "    except ImportError as err:\n"
            "        assert 'aisimulate_core' in str(err) and 'not installable here' in str(err), err\n"
            "    else:\n"
            "        raise AssertionError('a use of the stand-in did not raise')\n"
            "try:\n"
            "    import aisimulate_core.sdk.backends.factory\n"
            "except ImportError:\n"  # what dynamo/planner/monitoring/aic_estimator.py catches
            "    print('refused')\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={"PYTHONPATH": str(STUB)})
    assert proc.returncode == 0 and proc.stdout.strip() == "refused", proc.stderr


def test_the_sla_mode_is_refused_by_name():
    assert DYNAMO_PYTHON.exists(), "no .venv-dynamo: `make dynamo-venv` (make test builds it)"
    proc = subprocess.run([str(DYNAMO_PYTHON), "-m", "backend.dynamo.planner", "--config",
                           '{"environment": "virtual", "optimization_target": "sla", "model_name": "tiny"}'],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and SLA_REFUSED in proc.stderr, proc.stderr[-2000:]


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    # etcd: the virtual connector keeps the planner's decisions there. 32 blocks of 16 tokens: the 6 streams of the
    # high phase (~75 + 120 tokens each) hold ~2.3x one worker's pool
    c = start_cluster(tiny_model_dir, tmp_path_factory.mktemp("dynamo-planner-logs"), workers=1, discovery="etcd",
                      worker_args=("--num-kv-blocks", "32"))
    yield c
    c.stop()


def planner_log(cluster) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", (cluster.log_dir / "planner.log").read_text())  # without its colours


def wait_until(what: str, ready, scaler: Autoscaler, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert scaler.planner.poll() is None, f"the planner exited:\n{planner_log(scaler.cluster)[-3000:]}"
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s; decisions {scaler.decisions}; " \
                                            f"the planner's log ends:\n{planner_log(scaler.cluster)[-3000:]}"
        time.sleep(0.5)


def test_a_load_ramp_makes_the_planner_add_a_worker_and_later_remove_one(cluster, tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    expected = [tokenizer.decode(e) for e in hf_greedy(tiny_model_dir, ids, [TOKENS] * len(ids))]
    scaler = Autoscaler(cluster, LOAD, min_workers=1, max_workers=2)
    wait_until("the planner deciding", lambda: "[summary] HOLD" in planner_log(cluster), scaler, 240)
    client = OpenAI(base_url=cluster.url + "/v1", api_key="none", max_retries=0, timeout=120)
    texts: list[tuple[int, str]] = []
    errors: list[BaseException] = []
    high = threading.Event()

    def stream_on(i: int) -> None:  # greedy completions one after another while the phase is high
        try:
            while high.is_set():
                out = client.completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=TOKENS, temperature=0,
                                                extra_body={"ignore_eos": True}, stream=True)
                texts.append((i, "".join(c.choices[0].text for c in out if c.choices)))
        except BaseException as err:  # noqa: BLE001  (asserted in the test's thread)
            errors.append(err)

    low = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=TOKENS, temperature=0,
                                    extra_body={"ignore_eos": True})  # low: one request at a time, one worker
    texts.append((0, low.choices[0].text))
    high.set()
    threads = [threading.Thread(target=stream_on, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    try:
        wait_until("a second worker", lambda: any(d.workers == 2 for d in scaler.decisions), scaler, 180)
        time.sleep(3)  # the high phase goes on with both
    finally:
        high.clear()
        for t in threads:
            t.join(180)
    wait_until("back to one worker", lambda: scaler.decisions[-1].workers == 1, scaler, 180)  # low again
    log = planner_log(cluster)
    assert not errors, errors
    assert len(texts) > len(PROMPTS) and all(text == expected[i] for i, text in texts), \
        [(i, text[:60]) for i, text in texts if text != expected[i]]
    workers = [d.workers for d in scaler.decisions]
    assert workers[workers.index(2):].count(1) >= 1 and not any(d.error for d in scaler.decisions), scaler.decisions
    assert "[summary] SCALE_UP" in log and "[summary] SCALE_DOWN" in log, log[-3000:]
    assert max(float(u) for u in re.findall(r"Easy agg \S+: .* util=([\d.]+)", log)) >= 0.3
    stopped = sorted(cluster.stopped)
    assert len(stopped) == 1 and cluster.workers[stopped[0]].returncode == 0  # drained, not cut
    assert wait_kv_free(cluster, scaler.serving()) == 0  # and the one serving holds no block
    assert "aisimulate_core" not in log and scaler.planner.poll() is None  # the load mode never used the stand-in


# disaggregated: a prefill worker is added when one has 1,000 prompt tokens waiting, removed when none waits; 2
# requests at a time a worker, so the 6 streams of the high phase keep prompts waiting. Decode held (its KV is 42 %
# at most here: up at 95 %)
LOAD_DISAGG = {"prefill_scale_up_queue_tokens": 1000, "prefill_scale_down_queue_tokens": 0,
               "decode_scale_up_kv_rate": 95, "decode_scale_down_kv_rate": 0, "load_adjustment_interval_seconds": 1}
LONG = " ".join(f"w{i % 97}" for i in range(300))  # 861 tokens: each request's own first word makes it new to a cache


def test_the_planner_scales_prefill_workers_of_a_disaggregated_cluster(tiny_model_dir, tmp_path_factory):
    cluster = start_cluster(tiny_model_dir, tmp_path_factory.mktemp("dynamo-planner-disagg-logs"),
                            ("--max-num-seqs", "2"), workers=0, prefill_workers=1, decode_workers=1, discovery="etcd")
    try:
        scaler = Autoscaler(cluster, LOAD_DISAGG, min_workers=1, max_workers=2)
        wait_until("the planner deciding", lambda: "[summary] HOLD" in planner_log(cluster), scaler, 240)
        client = OpenAI(base_url=cluster.url + "/v1", api_key="none", max_retries=0, timeout=120)
        done: list[tuple[str, str, int]] = []  # (prompt, text, completion tokens)
        errors: list[BaseException] = []
        high = threading.Event()
        high.set()

        def stream_on(i: int) -> None:
            try:
                turn = 0
                while high.is_set():
                    prompt, turn = f"s{i}t{turn} {LONG}", turn + 1
                    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
                                                    extra_body={"ignore_eos": True})
                    done.append((prompt, out.choices[0].text, out.usage.completion_tokens))
            except BaseException as err:  # noqa: BLE001  (asserted in the test's thread)
                errors.append(err)

        threads = [threading.Thread(target=stream_on, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        try:
            wait_until("a second prefill worker", lambda: any(d.serving["prefill"] == 2 for d in scaler.decisions),
                       scaler, 180)
            time.sleep(3)
        finally:
            high.clear()
            for t in threads:
                t.join(180)
        wait_until("back to one prefill worker", lambda: scaler.decisions[-1].serving["prefill"] == 1, scaler, 180)
        log = planner_log(cluster)
        assert not errors, errors
        assert "[summary] SCALE_UP | current: prefill=1 decode=1 | recommended: prefill=2 decode=1" in log, log[-3000:]
        assert max(int(q) for q in re.findall(r"Load prefill \S+: queued=(\d+)", log)) >= 1000
        assert not any(d.error for d in scaler.decisions) and {d.serving["decode"] for d in scaler.decisions} == {1}
        tokenizer = load_tokenizer(tiny_model_dir)
        expected = hf_greedy(tiny_model_dir, [tokenizer(p)["input_ids"] for p, _, _ in done], [4] * len(done))
        assert all(n == 4 for _, _, n in done) and [t for _, t, _ in done] == [tokenizer.decode(e) for e in expected]
        stopped = sorted(cluster.stopped)
        assert stopped and all(cluster.roles[i] == "prefill" and cluster.workers[i].returncode == 0 for i in stopped)
        decode = cluster.roles.index("decode")  # a prefill worker stopping waited for its exports to be fetched
        assert worker_metric(cluster, decode, "llm_disagg_requests_total", 'prefill="local_after_failed_transfer"') == 0
        assert wait_kv_free(cluster, scaler.serving()) == 0
    finally:
        cluster.stop()
