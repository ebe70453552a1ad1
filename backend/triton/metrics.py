"""Prometheus metrics through Triton's python-backend custom-metrics API (served on the metrics port).

The MetricFamily objects are kept for the model's lifetime: once a family is garbage collected,
`Metric.set()` raises (seen in Triton 2.51), which would kill the engine loop. They must be gone before the stub
exits, though (the llm's finalize drops them): collected at the interpreter's exit, they segfault it.

The metrics are updated from one thread only, the engine loop's output thread (every `LoopObserver` hook
runs there). python_backend 24.10's `Metric` writes each update into shared memory it swaps in per call, with
the GIL released and no lock: two threads updating one metric at once crashed tritonserver 2.51
(std::bad_alloc, or SIGSEGV) on the first burst of 40 streams (measured 2026-11-23, with the loop's outputs
spread over two threads).
"""

from __future__ import annotations

import bisect
import itertools

from backend.engine.engine import EngineStats
from backend.serving.engine_thread import LoopObserver

LATENCY_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
BATCH_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048]


class Gauge:
    """A gauge that sends a value only when it differs from the last one sent: each update is a round trip to the
    server process, and the ten gauges a step sets rarely change at a step (one stream's decode: the KV blocks
    every 16 tokens); sent every step, their round trips ran beside the next step's forward and took its CPUs
    (SmolLM2 at one stream, Zen 5: the step 4.3 ms offline, 4.9-6.3 ms served)."""

    def __init__(self, metric):
        self._metric, self._value = metric, None

    def set(self, value: float) -> None:
        if value != self._value:
            self._metric.set(value)
            self._value = value


class Histogram:
    """A Prometheus histogram kept in this process and sent, by `flush`, as the counters of its series
    (`<name>_bucket{le=...}`, `<name>_sum`, `<name>_count`), each only when it grew. Triton's own histogram makes
    every observation a round trip to the server process, run between engine steps: the inter-token latency's and
    the step's two took 0.4 ms of a 9.4 ms token at one stream (0.17-0.21 ms each; SmolLM2, Zen 3, 2026-12-03), and
    at 40 streams 40 more round trips a step. The series are a native histogram's, which `histogram_quantile`
    reads the same; only their `# TYPE` lines say counter."""

    def __init__(self, counter, name: str, doc: str, buckets: list[float]):
        """`counter(name, doc, extra_labels)`: a new Triton counter."""
        self._bounds = [float(b) for b in buckets]
        self._counts = [0] * (len(buckets) + 1)  # per bucket, the last one +Inf; not cumulative
        self._sum = 0.0
        self._sent = [0] * len(self._counts)  # the cumulative counts as last sent; the last is the count
        self._sent_sum = 0.0
        les = [repr(b) for b in self._bounds] + ["+Inf"]
        self._buckets = [counter(f"{name}_bucket", doc, {"le": le}) for le in les]
        self._sum_counter = counter(f"{name}_sum", doc, None)
        self._count_counter = counter(f"{name}_count", doc, None)

    def observe(self, value: float) -> None:
        self._counts[bisect.bisect_left(self._bounds, value)] += 1  # le: a value on a bound counts in its bucket
        self._sum += value

    def flush(self) -> None:
        cumulative = list(itertools.accumulate(self._counts))
        if cumulative[-1] == self._sent[-1]:
            return
        for counter, now, before in zip(self._buckets, cumulative, self._sent):
            if now > before:
                counter.increment(now - before)
        self._count_counter.increment(cumulative[-1] - self._sent[-1])
        self._sum_counter.increment(self._sum - self._sent_sum)
        self._sent, self._sent_sum = cumulative, self._sum


class TritonMetrics(LoopObserver):
    def __init__(self, pb_utils, labels: dict[str, str]):
        fam = pb_utils.MetricFamily
        self._families = []

        def metric(name: str, doc: str, kind, extra: dict[str, str] | None = None):
            family = next((f for n, f in self._families if n == name), None)
            if family is None:
                family = fam(name=name, description=doc, kind=kind)
                self._families.append((name, family))
            made = family.Metric(labels={**labels, **(extra or {})})
            return Gauge(made) if kind == fam.GAUGE else made

        def counter(name: str, doc: str, extra: dict[str, str] | None = None):
            return metric(name, doc, fam.COUNTER, extra)

        self.running = metric("llm_num_requests_running", "Sequences in the running batch", fam.GAUGE)
        self.waiting = metric("llm_num_requests_waiting", "Sequences waiting for admission", fam.GAUGE)
        blocks_doc = "KV cache blocks by state (cached: free but holding a reusable prefix)"
        self.blocks = {state: metric("llm_kv_blocks", blocks_doc, fam.GAUGE, {"state": state})
                       for state in ("total", "used", "free", "cached")}
        self.hit_rate = metric("llm_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache, "
                               "over prompt tokens admitted", fam.GAUGE)
        self.preemptions = metric("llm_preemptions_total", "Sequences preempted (recompute)", fam.COUNTER)
        self.draft_tokens = metric("llm_spec_draft_tokens_total", "Speculative tokens verified (ngram or draft)",
                                   fam.COUNTER)
        self.accepted_tokens = metric("llm_spec_accepted_tokens_total", "Speculative tokens accepted", fam.COUNTER)
        self.lora_resident = metric("llm_lora_adapters_resident", "LoRA adapters loaded in memory", fam.GAUGE)
        self.lora_loads = metric("llm_lora_loads_total", "LoRA adapters loaded (at start, at run time, or again "
                                 "after an eviction)", fam.COUNTER)
        self.lora_evictions = metric("llm_lora_evictions_total", "LoRA adapters evicted to make room (max_loras)",
                                     fam.COUNTER)
        self._lora_requests: dict[str, object] = {}  # adapter name -> its request counter, made at its first request
        # per position of a draft in its step (1 = the first), made when a position is first drafted
        self._new_metric, self._counter = metric, fam.COUNTER
        self._position_counters: dict[tuple[str, int], object] = {}
        refused_doc = "Requests not admitted: overloaded (the waiting queue was full) or invalid"
        self.refused = {reason: metric("llm_requests_refused_total", refused_doc, fam.COUNTER, {"reason": reason})
                        for reason in ("overloaded", "invalid")}
        self.prompt_tokens = metric("llm_prompt_tokens_total", "Prompt tokens of finished requests", fam.COUNTER)
        self.generation_tokens = metric("llm_generation_tokens_total", "Generated tokens of finished requests",
                                        fam.COUNTER)
        self.step_tokens = Histogram(counter, "llm_step_tokens", "Tokens per engine step (batch size in tokens)",
                                     BATCH_BUCKETS)
        self.step_seconds = Histogram(counter, "llm_step_seconds", "Engine step time", LATENCY_BUCKETS)
        self.ttft = Histogram(counter, "llm_time_to_first_token_seconds", "From submission to the first token",
                              LATENCY_BUCKETS)
        self.itl = Histogram(counter, "llm_inter_token_latency_seconds", "Between consecutive tokens of a request",
                             LATENCY_BUCKETS)
        self._histograms = (self.step_tokens, self.step_seconds, self.ttft, self.itl)
        self.heartbeat = metric("llm_engine_heartbeat_timestamp_seconds", "Unix time the engine loop last went "
                                "round idle or after a step that did work (it stands still while a step runs or work "
                                "waits that no step takes); 0: not yet reported; -1: the loop has died", fam.GAUGE)
        self.cpu_threads = metric("llm_cpu_threads", "Threads the CPU forward runs on: fewer than it started with "
                                  "while other processes use the engine's CPUs; 0: not runtime torch on the CPU",
                                  fam.GAUGE)
        self._seen: dict[str, int] = {}  # the engine's running totals, as last added to their counters

    def on_step(self, s: EngineStats, step_seconds: float) -> None:
        self._update(s)
        if s.last_step_tokens:
            self.step_tokens.observe(s.last_step_tokens)
            self.step_seconds.observe(step_seconds)

    def on_idle(self, s: EngineStats) -> None:
        self._update(s)
        self._flush()

    def _flush(self) -> None:
        """The histograms' observations so far to the server: when the engine goes idle, with the heartbeat, and
        before a finished request's last response is sent."""
        for histogram in self._histograms:
            histogram.flush()

    def _update(self, s: EngineStats) -> None:
        """The gauges and the counters of engine totals (also after an abort that no step follows)."""
        self.running.set(s.num_running)
        self.waiting.set(s.num_waiting)
        for state, value in (("total", s.kv_blocks_total), ("used", s.kv_blocks_used),
                             ("free", s.kv_blocks_free), ("cached", s.kv_blocks_cached)):
            self.blocks[state].set(value)
        self.hit_rate.set(s.prefix_cache_hit_rate)
        for key, counter, total in (("preemptions", self.preemptions, s.num_preemptions),
                                    ("drafts", self.draft_tokens, s.num_draft_tokens),
                                    ("accepted", self.accepted_tokens, s.num_accepted_tokens)):
            self._add(key, counter, total)
        self.lora_resident.set(s.lora_resident)
        self.cpu_threads.set(s.cpu_threads)
        self._add("lora_loads", self.lora_loads, s.lora_loads)
        self._add("lora_evictions", self.lora_evictions, s.lora_evictions)
        for name, total in s.lora_requests:
            if name not in self._lora_requests:
                self._lora_requests[name] = self._new_metric("llm_lora_requests_total", "Requests by LoRA adapter",
                                                             self._counter, {"lora": name})
            self._add(f"lora@{name}", self._lora_requests[name], total)
        for kind, totals in (("drafted", s.drafted_by_position), ("accepted", s.accepted_by_position)):
            for j, total in enumerate(totals):
                if total:
                    self._add(f"{kind}@{j + 1}", self._position_counter(kind, j + 1), total)

    def _position_counter(self, kind: str, position: int):
        if (kind, position) not in self._position_counters:
            self._position_counters[kind, position] = self._new_metric(
                f"llm_spec_{kind}_tokens_by_position_total", f"Speculative tokens {kind}, by their position among "
                "their step's drafts (accepted over drafted: the acceptance rate per position)", self._counter,
                {"position": str(position)})
        return self._position_counters[kind, position]

    def _add(self, key: str, counter, total: int) -> None:
        """Bring a counter up to the engine's running total."""
        if total > self._seen.get(key, 0):
            counter.increment(total - self._seen.get(key, 0))
            self._seen[key] = total

    def on_heartbeat(self, last_round: float) -> None:
        self.heartbeat.set(last_round)
        self._flush()

    def on_refused(self, reason: str) -> None:
        self.refused[reason].increment(1)

    def on_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def on_token_interval(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def on_finished(self, num_prompt_tokens: int, num_output_tokens: int) -> None:
        self.prompt_tokens.increment(num_prompt_tokens)
        self.generation_tokens.increment(num_output_tokens)
        self._flush()
