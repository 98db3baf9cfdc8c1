"""The engine core: schedule -> execute -> update, one model step at a time."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from tokenmill.config import EngineConfig
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.outputs import EngineCoreOutput, SchedulerOutput, StepRecord
from tokenmill.core.remote_kv import RemoteKVLoads
from tokenmill.core.scheduler import Scheduler
from tokenmill.core.tier_loads import TierLoads
from tokenmill.executor.model_runner import Executor
from tokenmill.kv_offload.store import open_tier_store
from tokenmill.kv_transfer.connector import KVBlocks, KVConnector, make_connector
from tokenmill.kv_transfer.loader import BackgroundKVLoader
from tokenmill.request import Request, RequestStatus
from tokenmill.spec_decode.config import SpeculativeConfig
from tokenmill.spec_decode.proposer import Proposer
from tokenmill.structured_output.manager import StructuredOutputManager

# With nothing runnable but requests whose grammar is compiling or whose KV is arriving, the loop waits this
# long for one at most.
IDLE_WAIT_S = 0.05
# At exit, the disk tier's queued writes get this long (within the 10 s a replica's stop waits for its process).
CLOSE_FLUSH_S = 8.0
CLOSE_CHUNK_BLOCKS = 256

logger = logging.getLogger(__name__)


class ModelStepError(RuntimeError):
    """The executor raised on a plan: the requests in that plan cannot go on, the engine can (`fail_step`)."""

    def __init__(self, plan: SchedulerOutput) -> None:
        super().__init__(f"model step failed on {len(plan.scheduled)} requests")
        self.plan = plan


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor, max_model_len: int,
                 clock: Callable[[], float] = time.monotonic,
                 structured_output: StructuredOutputManager | None = None,
                 reasoning_tags: tuple[Sequence[int], Sequence[int]] | None = None) -> None:
        self.config = config
        self.executor = executor
        self.clock = clock
        self.kv = KVCacheManager(executor.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        lora = getattr(executor, "lora", None)  # the runner's adapters (multi-LoRA), if any
        self.scheduler = Scheduler(config, self.kv, max_model_len, clock, structured_output, reasoning_tags,
                                   None if lora is None else lora.cache,
                                   getattr(executor, "long_rope_threshold", None))
        spec = SpeculativeConfig.parse(config.speculative_config)
        self.proposer = Proposer(spec, config, executor.num_kv_blocks) if spec is not None else None
        self.num_steps = 0
        self.last_step: StepRecord | None = None
        # Prefill/decode disaggregation: a producer saves finished prompts' KV, a consumer loads it.
        self.connector: KVConnector | None = None
        self.kv_loader: BackgroundKVLoader | None = None
        self.kv_saved: dict[str, dict[str, Any]] = {}  # request id -> where its KV was saved (for its output)
        if config.kv_role is not None:
            self.connector = make_connector(config.kv_transport, serve=config.kv_role == "producer")
            if config.kv_role == "producer":
                self.scheduler.finish_hook = self._save_kv
            else:
                self.kv_loader = BackgroundKVLoader(self.connector, executor)
                self.scheduler.remote_kv = RemoteKVLoads(self.kv, self.kv_loader)
        # KV tiers under the pool: the blocks it evicts are kept there, prompts read them back
        self.tiers = open_tier_store(config, executor)
        if self.tiers is not None:
            self.kv.pool.on_evict = self._keep_evicted_blocks
            self.scheduler.tier_loads = TierLoads(self.kv, self.tiers, executor.kv_block_bytes)  # type: ignore[attr-defined]

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: Iterable[str]) -> list[str]:
        return self.scheduler.abort_requests(request_ids)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        self.scheduler.finish_requests(request_ids, status)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        start = time.perf_counter()
        started = self.clock()  # the step's time on the engine's clock (simulated in tokenmill sim)
        plan = self.scheduler.schedule()
        if plan.is_empty and self.scheduler.loading:  # only KV loads in flight: wait for one, do not spin
            if self.kv_loader is not None:
                self.kv_loader.wait(IDLE_WAIT_S)
            elif self.tiers is not None:
                self.tiers.wait(IDLE_WAIT_S)
        if plan.is_empty:  # do not spin while the grammar worker or an adapter's read needs the CPU
            self.scheduler.grammars.wait_for_one(IDLE_WAIT_S)
            self.scheduler.loras.wait_for_one(IDLE_WAIT_S)
        try:
            output = self.executor.execute(plan)
        except Exception as exc:
            raise ModelStepError(plan) from exc
        outputs = self.scheduler.update(plan, output)
        if self.kv_saved:
            for out in outputs:
                out.kv_transfer_params = self.kv_saved.pop(out.request_id, None)
        self.num_steps += 1
        stats = self.scheduler.last_stats
        stats.num_generated_tokens = sum(len(o.new_token_ids) for o in outputs)
        if self.tiers is not None:
            stats.kv_tiers = self.tiers.counters()
            self._publish_tier_drops()
        token_budget = self.scheduler.token_budget
        if token_budget is not None and plan.scheduled:
            stats.step_seconds = self.clock() - started
            stats.over_target = token_budget.observe(plan, stats.step_seconds)
            stats.prediction_error = token_budget.predictor.last_error
        if self.scheduler.tier_loads is not None:
            prompt_tokens = sum(s.num_tokens for s in plan.scheduled if s.num_tokens > 1)
            self.scheduler.tier_loads.observe_prefill(prompt_tokens, time.perf_counter() - start)
        if self.proposer is not None:
            self.proposer.observe_step(plan, time.perf_counter() - start, stats)
            self.proposer.propose(self.scheduler.running)
        # queue and memory state as the step leaves it (finished requests are gone)
        stats.num_running, stats.num_waiting, stats.kv_usage = self.current_state()
        self.last_step = StepRecord(self.num_steps, time.perf_counter() - start, stats, plan, start)
        return outputs

    def _publish_tier_drops(self) -> None:
        """Blocks gone from every tier (and not back in the pool) leave this engine's prefix cache: a "removed"
        KV event, so a cache-aware router stops sending their prefixes here."""
        assert self.tiers is not None
        pool = self.kv.pool
        gone = self.tiers.drain_dropped()
        if pool.events is not None:
            pool.events.extend(("removed", key) for key in gone if not pool.holds(key))

    def held_prefix_blocks(self) -> list[int]:
        """The block hashes this engine can serve a prefix from: the pool's and the tiers'."""
        held = [b.block_hash for b in self.kv.pool.blocks if b.block_hash is not None]
        return held + (self.tiers.held_keys() if self.tiers is not None else [])

    def _keep_evicted_blocks(self, evicted: list[tuple[int, tuple[int, ...], int]]) -> None:
        """Cached blocks the pool takes for reuse go to the tiers, read before anything overwrites them (the
        schedule allocates, the step after it writes)."""
        assert self.tiers is not None
        keys, token_ids, block_ids = zip(*evicted, strict=True)
        data = self.executor.read_kv_blocks(list(block_ids))  # type: ignore[attr-defined]
        self.tiers.save(list(keys), list(token_ids), data)

    def close(self) -> None:
        """Before the process exits: the prefix blocks still in the pool go to the tiers (so a restart finds
        them on disk), and the queued disk writes finish."""
        if self.tiers is None:
            return
        deadline = time.monotonic() + CLOSE_FLUSH_S
        if self.tiers.disk is not None:
            cached = [b for b in self.kv.pool.blocks if b.block_hash is not None]
            for start in range(0, len(cached), CLOSE_CHUNK_BLOCKS):  # a chunk at a time: bounded memory
                chunk = cached[start:start + CLOSE_CHUNK_BLOCKS]
                data = self.executor.read_kv_blocks([b.block_id for b in chunk])  # type: ignore[attr-defined]
                self.tiers.save([b.block_hash for b in chunk if b.block_hash is not None],
                                [b.token_ids for b in chunk], data, to_host=False)
                if not self.tiers.flush(max(0.0, deadline - time.monotonic())):
                    logger.warning("KV disk tier: blocks still to write at exit were dropped")
                    break
        self.tiers.close()

    def _save_kv(self, request: Request) -> None:
        """Producer: a prompt run for a decode engine is done (its one token sampled): save its KV blocks."""
        if request.status == RequestStatus.FINISHED_ABORTED or self.connector is None:
            return
        block_size = self.kv.block_size
        num_tokens = request.num_prompt_tokens
        block_ids = self.kv.block_table(request.request_id)[:-(-num_tokens // block_size)]
        data = self.executor.read_kv_blocks(block_ids)  # type: ignore[attr-defined]
        blocks = KVBlocks(data, request.block_hashes[:num_tokens // block_size], num_tokens)
        params = self.connector.save(request.request_id, blocks)
        kv_format = getattr(self.executor, "kv_format", None)  # a consumer with another cache format refuses them
        self.kv_saved[request.request_id] = params if kv_format is None else params | {"kv_format": kv_format.name}

    def release_kv(self, request_ids: Iterable[str]) -> None:
        """Producer: the decode engine has these requests' KV (or no longer needs it)."""
        if self.connector is not None:
            for request_id in request_ids:
                self.connector.release(request_id)

    def fail_step(self, plan: SchedulerOutput) -> list[str]:
        """Abort the requests of a plan whose step raised; returns their ids. The step may have written part of
        their new KV, so the blocks it wrote leave the prefix cache before they are freed."""
        for scheduled in plan.scheduled:
            self.kv.forget_cached_blocks(scheduled.request_id, scheduled.start_position)
        return self.abort_requests([s.request_id for s in plan.scheduled])

    def load_tokens(self) -> int:
        """Waiting + running tokens: the load a router balances on."""
        return sum(r.num_tokens for r in self.scheduler.requests.values())

    def current_state(self) -> tuple[int, int, float]:
        """(running, waiting, KV usage) right now."""
        return len(self.scheduler.running), self.scheduler.num_waiting, self.kv.usage()
