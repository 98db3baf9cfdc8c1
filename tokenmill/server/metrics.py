"""Prometheus metrics, named like vLLM's with a `tokenmill:` prefix.

The core only timestamps events; this module turns them into histograms when a request finishes and reads
gauges and counters from each step's stats.
"""

from __future__ import annotations

import re

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

from tokenmill.core.outputs import StepRecord
from tokenmill.engine.core_messages import CoreInfo
from tokenmill.outputs import RequestOutput

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
_BYTE_BUCKETS = tuple(float(2**i) for i in range(16, 34, 2))
_THROUGHPUT_BUCKETS = tuple(float(10**i) for i in range(6, 12))
_TOKEN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)


def metric_value(exposition: str, name: str) -> float | None:
    """The first sample of `name` in Prometheus text exposition (any labels), or None when absent."""
    match = re.search(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? ([0-9.e+-]+)$", exposition, re.M)
    return float(match.group(1)) if match else None


class EngineMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        per_replica = ["model_name", "replica"]  # what one engine core reports (data parallel: one series each)
        r = self.registry
        ProcessCollector(registry=r)  # process_resident_memory_bytes & co., as in vLLM's default registry
        self.ttft = Histogram("tokenmill:time_to_first_token_seconds", "Time to first token", labels,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("tokenmill:inter_token_latency_seconds", "Inter-token latency", labels,
                             buckets=_TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("tokenmill:e2e_request_latency_seconds", "End-to-end request latency", labels,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("tokenmill:request_queue_time_seconds", "Time waiting before first scheduled",
                                    labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.running = Gauge("tokenmill:num_requests_running", "Requests in the running batch", per_replica, registry=r)
        self.waiting = Gauge("tokenmill:num_requests_waiting", "Requests waiting to be scheduled", per_replica,
                             registry=r)
        self.kv_usage = Gauge("tokenmill:kv_cache_usage_perc", "Share of KV blocks in use (0-1)", per_replica,
                              registry=r)
        # vLLM's cache_config_info: the pool's configuration as labels, value 1; and what it holds, in tokens
        self.cache_config = Gauge("tokenmill:cache_config_info", "KV cache configuration",
                                  per_replica + ["cache_dtype", "block_size", "num_blocks"], registry=r)
        self.kv_capacity = Gauge("tokenmill:kv_cache_capacity_tokens", "Tokens the KV pool holds", per_replica,
                                 registry=r)
        self.prefix_queries = Counter("tokenmill:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      per_replica, registry=r)
        self.prefix_hits = Counter("tokenmill:prefix_cache_hits", "Prompt tokens found in the prefix cache",
                                   per_replica, registry=r)
        self.preemptions = Counter("tokenmill:num_preemptions", "Preemptions", per_replica, registry=r)
        # the KV tiers under the pool (--kv-offload-memory, --kv-cache-dir)
        self.tier_hits = Counter("tokenmill:kv_tier_hit_blocks", "Prefix blocks read back from a KV tier",
                                 per_replica + ["tier"], registry=r)
        self.tier_bytes = Counter("tokenmill:kv_tier_loaded_bytes", "Bytes read back from a KV tier",
                                  per_replica + ["tier"], registry=r)
        self.tier_evictions = Counter("tokenmill:kv_tier_evicted_blocks", "Blocks a KV tier dropped (least "
                                      "recently used first)", per_replica + ["tier"], registry=r)
        self.tier_loads = Counter("tokenmill:kv_tier_loads", "Prefix loads from the KV tiers (one per request)",
                                  per_replica, registry=r)
        self.tier_load_seconds = Counter("tokenmill:kv_tier_load_seconds", "Time the KV tier loads took, from "
                                         "admission to the blocks stored (divide by kv_tier_loads)", per_replica,
                                         registry=r)
        self.tier_written = Counter("tokenmill:kv_tier_disk_written_bytes", "Bytes written to the disk tier",
                                    per_replica, registry=r)
        self._last_tiers: dict[str, dict[str, float]] = {}
        self.prompt_tokens = Counter("tokenmill:prompt_tokens", "Prompt tokens processed", labels, registry=r)
        self.generation_tokens = Counter("tokenmill:generation_tokens", "Tokens generated", labels, registry=r)
        self.success = Counter("tokenmill:request_success", "Finished requests by finish reason",
                               labels + ["finished_reason"], registry=r)
        # --target-itl-ms
        self.prompt_budget = Histogram("tokenmill:prompt_chunk_budget_tokens", "Prompt tokens a step was allowed "
                                       "(--target-itl-ms)", per_replica, registry=r,
                                       buckets=(16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192))
        self.steps_over_target = Counter("tokenmill:steps_over_target", "Steps with decodes running that took "
                                         "longer than --target-itl-ms", per_replica, registry=r)
        self.prediction_error = Histogram("tokenmill:step_time_prediction_error_seconds", "Measured minus "
                                          "predicted step time (--target-itl-ms)", per_replica, registry=r,
                                          buckets=(-0.1, -0.03, -0.01, -0.003, 0.0, 0.003, 0.01, 0.03, 0.1, 0.3))
        self.endpoint_requests = Counter("tokenmill:endpoint_requests", "Finished requests by API endpoint",
                                         labels + ["endpoint"], registry=r)
        self.lora_requests = Counter("tokenmill:lora_requests", "Finished requests by LoRA adapter",
                                     labels + ["lora_name"], registry=r)
        # vLLM's shape: one series, its labels the adapters running and waiting now, its value the time it was set
        self.lora_info = Gauge("tokenmill:lora_requests_info", "Running and waiting LoRA adapters",
                               per_replica + ["max_lora", "running_lora_adapters", "waiting_lora_adapters"], registry=r)
        self._lora_labels: dict[str, tuple[str, ...]] = {}
        self.spec_drafts = Counter("tokenmill:spec_decode_num_drafts", "Speculative proposals verified", per_replica,
                                   registry=r)
        self.spec_draft_tokens = Counter("tokenmill:spec_decode_num_draft_tokens", "Proposed tokens verified",
                                         per_replica, registry=r)
        self.spec_accepted_tokens = Counter("tokenmill:spec_decode_num_accepted_tokens", "Proposed tokens accepted",
                                            per_replica, registry=r)
        self.spec_accepted_per_pos = Counter("tokenmill:spec_decode_num_accepted_tokens_per_pos",
                                             "Proposed tokens accepted, by position in the proposal",
                                             per_replica + ["position"], registry=r)
        self.replica_up = Gauge("tokenmill:replica_up", "1 while the engine core serves, 0 while down or restarting",
                                per_replica, registry=r)
        self.replica_restarts = Counter("tokenmill:replica_restarts", "Engine core restarts after a failure",
                                        per_replica, registry=r)
        self.request_migrations = Counter("tokenmill:request_migrations", "Requests moved off an engine core that "
                                          "died, to continue elsewhere (by the core they left)", per_replica,
                                          registry=r)
        self.router_decisions = Counter("tokenmill:router_decisions",
                                        "Requests routed, by reason (prefix: for its cached blocks; load: least "
                                        "loaded; round-robin)", ["model_name", "replica", "reason"], registry=r)
        self.router_matched_blocks = Counter("tokenmill:router_matched_blocks",
                                             "Prompt blocks the chosen replica held when routed for its prefix",
                                             per_replica, registry=r)
        self.kv_transfer_bytes = Histogram("tokenmill:kv_transfer_bytes", "KV bytes moved to a decode engine per "
                                           "request (disaggregated)", labels, buckets=_BYTE_BUCKETS, registry=r)
        self.kv_transfer_seconds = Histogram("tokenmill:kv_transfer_seconds", "Time to fetch and store a request's "
                                             "KV on the decode engine", labels, buckets=_TOKEN_BUCKETS, registry=r)
        self.kv_transfer_throughput = Histogram("tokenmill:kv_transfer_throughput_bytes_per_second",
                                                "KV transfer throughput per request", labels,
                                                buckets=_THROUGHPUT_BUCKETS, registry=r)
        self.kv_handoff_seconds = Histogram("tokenmill:kv_handoff_seconds", "From a prompt done on the prefill "
                                            "engine to its KV loaded on the decode engine (queueing included)",
                                            labels, buckets=_TOKEN_BUCKETS, registry=r)
        self.kv_pending = Gauge("tokenmill:kv_transfer_pending", "Prompts whose saved KV a prefill engine still "
                                "holds for a decode engine", per_replica, registry=r)
        self.model_name = model_name
        for metric in (self.ttft, self.itl, self.e2e, self.queue_time, self.prompt_tokens, self.generation_tokens):
            metric.labels(model_name)  # exposed (at zero) from the start
        self._last_prefix: dict[str, tuple[int, int]] = {}  # per replica: its scheduler's cumulative counters
        self._restarts_seen: dict[int, int] = {}

    def add_replicas(self, num_replicas: int) -> None:
        for i in range(num_replicas):
            for metric in (self.running, self.waiting, self.kv_usage, self.prefix_queries, self.prefix_hits,
                           self.preemptions, self.replica_up, self.replica_restarts, self.request_migrations):
                metric.labels(self.model_name, str(i))

    def on_cache_config(self, replica: int, info: CoreInfo) -> None:
        self.cache_config.labels(self.model_name, str(replica), info.kv_cache_dtype, str(info.block_size),
                                 str(info.num_kv_blocks)).set(1)
        self.kv_capacity.labels(self.model_name, str(replica)).set(info.num_kv_blocks * info.block_size)

    def on_step(self, record: StepRecord, replica: int = 0) -> None:
        s = record.stats
        m, r = self.model_name, str(replica)
        self.running.labels(m, r).set(s.num_running)
        self.waiting.labels(m, r).set(s.num_waiting)
        self.kv_usage.labels(m, r).set(s.kv_usage)
        if s.num_preemptions:
            self.preemptions.labels(m, r).inc(s.num_preemptions)
        if s.prompt_budget is not None:
            self.prompt_budget.labels(m, r).observe(s.prompt_budget)
        if s.over_target:
            self.steps_over_target.labels(m, r).inc()
        if s.prediction_error is not None:
            self.prediction_error.labels(m, r).observe(s.prediction_error)
        if s.spec_num_drafts:
            self.spec_drafts.labels(m, r).inc(s.spec_num_drafts)
            self.spec_draft_tokens.labels(m, r).inc(s.spec_num_draft_tokens)
            self.spec_accepted_tokens.labels(m, r).inc(s.spec_num_accepted_tokens)
            for position, count in enumerate(s.spec_accepted_per_pos):
                self.spec_accepted_per_pos.labels(m, r, str(position)).inc(count)
        if s.running_loras is not None and s.waiting_loras is not None:
            self._set_lora_info(r, s.max_loras, s.running_loras, s.waiting_loras)
        last_queries, last_hits = self._last_prefix.get(r, (0, 0))
        if s.prefix_queries < last_queries:  # a restarted replica counts from zero again
            last_queries = last_hits = 0
        if s.prefix_queries > last_queries:
            self.prefix_queries.labels(m, r).inc(s.prefix_queries - last_queries)
        if s.prefix_hits > last_hits:
            self.prefix_hits.labels(m, r).inc(s.prefix_hits - last_hits)
        self._last_prefix[r] = (s.prefix_queries, s.prefix_hits)
        if s.kv_tiers is not None:
            self._on_tiers(r, s.kv_tiers)

    def _on_tiers(self, replica: str, now: dict[str, float]) -> None:
        """Advance the tier counters by what the replica's cumulative ones grew since its last step."""
        last = self._last_tiers.get(replica, {})
        if now.get("loads", 0) < last.get("loads", 0):  # a restarted replica counts from zero again
            last = {}
        grew = {name: value - last.get(name, 0) for name, value in now.items()}
        m = self.model_name
        for tier in ("host", "disk"):
            for metric, name in ((self.tier_hits, "hits"), (self.tier_bytes, "bytes"),
                                 (self.tier_evictions, "evictions")):
                if grew.get(f"{tier}_{name}", 0) > 0:
                    metric.labels(m, replica, tier).inc(grew[f"{tier}_{name}"])
        for metric, name in ((self.tier_loads, "loads"), (self.tier_load_seconds, "load_seconds"),
                             (self.tier_written, "disk_written_bytes")):
            if grew.get(name, 0) > 0:
                metric.labels(m, replica).inc(grew[name])
        self._last_tiers[replica] = dict(now)

    def _set_lora_info(self, replica: str, max_loras: int, running: list[str], waiting: list[str]) -> None:
        labels = (self.model_name, replica, str(max_loras), ",".join(running), ",".join(waiting))
        previous = self._lora_labels.get(replica)
        if previous is not None and previous != labels:
            self.lora_info.remove(*previous)  # one series per replica, as vLLM keeps one
        self.lora_info.labels(*labels).set_to_current_time()
        self._lora_labels[replica] = labels

    def set_idle(self, running: int, waiting: int, kv_usage: float, replica: int = 0) -> None:
        m, r = self.model_name, str(replica)
        self.running.labels(m, r).set(running)
        self.waiting.labels(m, r).set(waiting)
        self.kv_usage.labels(m, r).set(kv_usage)

    def on_replica(self, index: int, state: str, restarts: int) -> None:
        m, r = self.model_name, str(index)
        self.replica_up.labels(m, r).set(1.0 if state == "up" else 0.0)
        if restarts > self._restarts_seen.get(index, 0):  # the counter follows the replica's own count
            self.replica_restarts.labels(m, r).inc(restarts - self._restarts_seen.get(index, 0))
            self._restarts_seen[index] = restarts

    def on_migration(self, request_id: str, source: int, target: int | None) -> None:
        self.request_migrations.labels(self.model_name, str(source)).inc()

    def on_kv_transfer(self, request_id: str, nbytes: int, seconds: float, handoff_seconds: float) -> None:
        m = self.model_name
        self.kv_transfer_bytes.labels(m).observe(nbytes)
        self.kv_transfer_seconds.labels(m).observe(seconds)
        if seconds > 0:
            self.kv_transfer_throughput.labels(m).observe(nbytes / seconds)
        self.kv_handoff_seconds.labels(m).observe(handoff_seconds)

    def on_kv_pending(self, replica: int, pending: int) -> None:
        self.kv_pending.labels(self.model_name, str(replica)).set(pending)

    def on_route(self, replica: int, reason: str, matched_blocks: int) -> None:
        m, r = self.model_name, str(replica)
        self.router_decisions.labels(m, r, reason).inc()
        if matched_blocks:
            self.router_matched_blocks.labels(m, r).inc(matched_blocks)

    def on_finished(self, output: RequestOutput, endpoint: str | None = None, lora_name: str | None = None) -> None:
        m = self.model_name
        if endpoint is not None:
            self.endpoint_requests.labels(m, endpoint).inc()
        if lora_name is not None:
            self.lora_requests.labels(m, lora_name).inc()
        self.prompt_tokens.labels(m).inc(len(output.prompt_token_ids))
        for completion, times in zip(output.outputs, output.metrics):
            self.generation_tokens.labels(m).inc(len(completion.token_ids))
            self.success.labels(m, completion.finish_reason or "unknown").inc()
            if times.first_token_time is not None:
                self.ttft.labels(m).observe(times.first_token_time - times.arrival_time)
            for earlier, later in zip(times.token_times, times.token_times[1:]):
                self.itl.labels(m).observe(later - earlier)
            if times.finished_time is not None:
                self.e2e.labels(m).observe(times.finished_time - times.arrival_time)
            if times.first_scheduled_time is not None:
                self.queue_time.labels(m).observe(times.first_scheduled_time - times.arrival_time)
