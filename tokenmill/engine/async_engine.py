"""AsyncLLM: the front end of the engine. Requests are validated and routed here; engine cores (replicas) step
elsewhere, and asyncio callers stream per-request outputs.

A replica is a thread of this process (`AsyncLLM.from_engine`) or its own process (`AsyncLLM.launch`, N of
them for data parallelism, behind a router). Either way the front end only sends commands (add, abort,
finish-by-stop-string) and reads reports (outputs, step stats, load, KV events): tokenization happens in the
HTTP handlers and detokenization / stop strings in the event loop (the output processor), so neither stalls a
model step, and a step never waits for a client. A replica that dies leaves the rotation and is relaunched; its
unfinished requests continue on another one, or on the relaunched one (engine/migration.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from tokenmill.config import EngineConfig
from tokenmill.core.outputs import StepRecord
from tokenmill.engine.core_messages import CoreDeath, CoreReport
from tokenmill.engine.migration import HeldGroup, Migrations
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.engine.processor import InputProcessor, PromptType, model_limits
from tokenmill.engine.replica import Message, ProcessReplica, Replica, ReplicaExit, ThreadReplica, cpu_share
from tokenmill.engine.request_stream import RequestStream
from tokenmill.kv_transfer.handoff import Handoffs, discard, prefill_copy
from tokenmill.lora.request import LoRARequest
from tokenmill.outputs import RequestOutput
from tokenmill.request import Request
from tokenmill.router.policy import Decision, Router, make_router
from tokenmill.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenmill.engine.llm_engine import LLMEngine

logger = logging.getLogger("tokenmill.engine")


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound: the caller should retry later (HTTP 429)."""


class EngineDeadError(RuntimeError):
    """No engine core can take the request (HTTP 503): it died, or is being restarted."""


class EngineStepError(RuntimeError):
    """The model step this request was in raised; the request is failed (HTTP 500), the engine goes on."""


# A replica whose relaunch fails this many times in a row is given up.
MAX_LAUNCH_ATTEMPTS = 3
DISCARD_DELAY_S = 2.0  # a released shared-memory KV file the producer has not removed by then goes anyway

StepListener = Callable[[StepRecord, int], None]  # (record, replica)
StateListener = Callable[[int, int, float, int], None]  # (running, waiting, KV usage, replica) when no step ran
ReplicaListener = Callable[[Replica], None]  # a replica changed state


class _Load:
    """What the front end knows of a replica's queue: its last report plus the adds sent since."""

    def __init__(self) -> None:
        self.waiting = 0
        self.load_tokens = 0
        self.unacked: deque[tuple[int, int, int]] = deque()  # (command seq, requests, tokens)

    def acknowledge(self, acked: int, waiting: int, load_tokens: int) -> None:
        while self.unacked and self.unacked[0][0] <= acked:
            self.unacked.popleft()
        self.waiting, self.load_tokens = waiting, load_tokens

    def total_waiting(self) -> int:
        return self.waiting + sum(n for _, n, _ in self.unacked)

    def total_tokens(self) -> int:
        return self.load_tokens + sum(t for _, _, t in self.unacked)


# Added to the prefill engines' nice value by `launch_disaggregated` (they share their CPUs with the front end).
PREFILL_NICENESS = 10


class AsyncLLM:
    def __init__(self, processor: InputProcessor, output_processor: OutputProcessor, replicas: list[Replica],
                 router: Router | None = None, max_waiting_requests: int | None = None) -> None:
        self.processor = processor
        self.output_processor = output_processor
        self.replicas = replicas
        self.router = router or make_router("round-robin", len(replicas), processor.config.block_size)
        # Disaggregated: `router` picks among the prefill engines, `decode_router` among the decode engines.
        self.disaggregated = any(r.role is not None for r in replicas)
        self.decode_router: Router | None = None
        if self.disaggregated:
            self.decode_router = make_router(self.router.name, len(replicas), processor.config.block_size)
            self.router.excluded = {r.index for r in replicas if r.role != "producer"}
            self.decode_router.excluded = {r.index for r in replicas if r.role != "consumer"}
        self.handoffs = Handoffs(replicas, self._submit_decode, lambda child: self.output_processor.request(child)
                                 is not None, self._discard_later)
        self.max_waiting_requests = max_waiting_requests or processor.config.max_waiting_requests
        self._loads = [_Load() for _ in replicas]
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._parents: dict[str, str] = {}  # engine request (one per sample) -> the request id it belongs to
        self._replica_of: dict[str, int] = {}  # engine request -> the replica serving it now
        self._restarts: set[asyncio.Task[None]] = set()
        self.step_listeners: list[StepListener] = []
        self.state_listeners: list[StateListener] = []
        self.route_listeners: list[Callable[[Decision], None]] = []
        self.replica_listeners: list[ReplicaListener] = []
        self.fatal_listeners: list[Callable[[BaseException], None]] = []  # no replica is left
        # (engine request, KV bytes, transfer seconds, seconds from prefill done to KV loaded)
        self.transfer_listeners: list[Callable[[str, int, float, float], None]] = []
        self.pending_kv_listeners: list[Callable[[int, int], None]] = []  # (replica, saved KV not released)
        self.migrations = Migrations(output_processor, processor.config.migration_limit)
        self.dead_error: BaseException | None = None

    @classmethod
    def from_engine(cls, engine: LLMEngine, max_waiting_requests: int | None = None) -> AsyncLLM:
        """One engine core stepping in a thread of this process, over an engine already built."""
        replica = ThreadReplica(0, engine.core)
        replica.launch()
        return cls(engine.processor, engine.output_processor, [replica], None, max_waiting_requests)

    @classmethod
    def launch(cls, config: EngineConfig, data_parallel_size: int = 1, router: str = "prefix-aware",
               send_plans: bool = False, log_level: str = "INFO") -> AsyncLLM:
        """`data_parallel_size` engine-core processes on this machine, each pinned to its share of the CPUs,
        behind `router`. Blocks until every core has loaded the model."""
        replicas: list[Replica] = [
            ProcessReplica(i, config, cpu_share(i, data_parallel_size), send_plans,
                           kv_events=data_parallel_size > 1, log_level=log_level)
            for i in range(data_parallel_size)
        ]
        return cls.over_replicas(config, replicas, router)

    @classmethod
    def launch_disaggregated(cls, config: EngineConfig, num_prefill: int, num_decode: int, transport: str = "shm",
                             router: str = "prefix-aware", send_plans: bool = False,
                             log_level: str = "INFO") -> AsyncLLM:
        """`num_prefill` prefill engines and `num_decode` decode engines, one process each, the CPUs split
        between them; KV moves from one to the other through `transport`."""
        total = num_prefill + num_decode
        replicas: list[Replica] = [
            ProcessReplica(i, dataclasses.replace(config, kv_role="producer" if i < num_prefill else "consumer",
                                                  kv_transport=transport),
                           cpu_share(i, total), send_plans, kv_events=True, log_level=log_level,
                           niceness=PREFILL_NICENESS if i < num_prefill else 0)
            for i in range(total)
        ]
        # This process (API server, tokenizer, detokenizer) joins the prefill engines on their CPUs, leaving the
        # decode engines' to them alone: a decode step then never waits for the front end, while a prefill
        # (throughput work) lends it the moments it needs. Measured here (1P1D, long prompts arriving): the
        # short streams' gaps over 25 ms during a long prefill 38 -> 8. The prefill engines run niced, so the
        # front end relaying decode tokens gets its CPU as soon as it wakes: at equal priority, step traces
        # showed 25-80 ms client gaps over decode steps of normal length (worst gap 2.0-5.1x the median
        # inter-token time over 6 runs; niced, 1.8-4.9x over 12, the rest from decode steps and host jitter).
        front_end_cpus = {cpu for i in range(num_prefill) for cpu in cpu_share(i, total)}
        if front_end_cpus and front_end_cpus != set(os.sched_getaffinity(0)):
            os.sched_setaffinity(0, front_end_cpus)
        return cls.over_replicas(config, replicas, router)

    @classmethod
    def over_replicas(cls, config: EngineConfig, replicas: list[Replica], router: str) -> AsyncLLM:
        """Launch the replicas side by side and build the front end over them. This process reads only the
        tokenizer and the model's metadata (weights load lazily, so it never reads them)."""
        import concurrent.futures

        from tokenmill.encoder.front import encoder_core_config, read_encoder_front, serves_encoder
        from tokenmill.model.metadata import read_metadata
        from tokenmill.model.tokenizer import Tokenizer

        # The replicas start (and load their weights) while this process builds its tokenizer. Their requests
        # go to the fork server first: parsing a tokenizer holds the GIL (0.7 s for Gemma 3's 262k pieces), and a
        # launch that had not handed its request over by then started its core that much later. Reading the
        # header (Python, which passes the GIL on every few ms) gives the launch thread the moments it needs.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            launching = pool.submit(launch_all, replicas)
            try:
                encoder = read_encoder_front(config) if serves_encoder(config) else None
                if encoder is None:
                    loaded = read_metadata(config.model)
                    tokenizer = Tokenizer.from_path(loaded.path, loaded.gguf_reader, config.chat_template)
            except BaseException:
                launching.result()  # then stop what it started: this error (a bad file) is the one to report
                for replica in replicas:
                    replica.stop(timeout=1.0)
                raise
            launching.result()
        capacity = min(r.info.num_kv_blocks * r.info.block_size for r in replicas if r.info is not None)
        if encoder is not None:  # embedding requests only: no end of sequence, no prefix salt, no chat
            tokenizer = encoder.tokenizer.as_tokenizer()
            processor = InputProcessor(encoder_core_config(config, encoder.max_model_len), tokenizer,
                                       encoder.max_model_len, (), encoder.config.vocab_size, capacity, encoder=encoder)
        else:
            max_model_len, eos = model_limits(loaded.config, tokenizer, config)
            processor = InputProcessor(config, tokenizer, max_model_len, eos, loaded.config.vocab_size, capacity,
                                       cache_salt_of=loaded.config.rope_cache_key, model_config=loaded.config)
        return cls(processor, OutputProcessor(tokenizer), replicas, make_router(router, len(replicas),
                                                                                config.block_size))

    # ------------------------------------------------------------------ what the server reads

    @property
    def config(self) -> EngineConfig:
        return self.processor.config

    @property
    def tokenizer(self) -> Any:
        return self.processor.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.processor.max_model_len

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        for replica in self.replicas:
            if replica.info is None:
                replica.launch()
            self._start(replica)

    def _start(self, replica: Replica) -> None:
        loop, index, generation = self._loop, replica.index, replica.generation
        assert loop is not None

        def deliver(message: Message) -> None:
            if not loop.is_closed():
                loop.call_soon_threadsafe(self._on_message, index, generation, message)

        replica.start(deliver)
        replica.state = "up"
        for router in self._routers():
            router.set_alive(index, True)
        self._loads[index] = _Load()
        for listener in self.replica_listeners:
            listener(replica)
        for group in self.migrations.release_held(self._can_place):
            self._place(group, count=False)

    def _routers(self) -> list[Router]:
        return [self.router] if self.decode_router is None else [self.router, self.decode_router]

    async def shutdown(self) -> None:
        for replica in self.replicas:  # a core that exits from now on is stopping, not down: never relaunched
            replica.state = "stopping"
        for task in self._restarts:
            task.cancel()
        await asyncio.gather(*(asyncio.to_thread(r.stop) for r in self.replicas))

    @property
    def is_running(self) -> bool:
        return self.dead_error is None and any(r.state == "up" for r in self.replicas)

    # ------------------------------------------------------------------ reports from the replicas

    def _on_message(self, index: int, generation: int, message: Message) -> None:
        replica = self.replicas[index]
        if generation != replica.generation:
            return  # from a process that has been replaced
        if isinstance(message, CoreReport):
            if replica.state not in ("up", "stopping"):
                return  # sent before it died: its requests have moved on
            self._on_report(replica, message)
        elif isinstance(message, CoreDeath):
            self._replica_down(replica, f"the engine stopped after an internal error: {message.message}")
        elif isinstance(message, ReplicaExit) and replica.state == "up":
            self._replica_down(replica, f"engine core {index} exited (exit code {message.exitcode})")

    def _on_report(self, replica: Replica, report: CoreReport) -> None:
        index = replica.index
        info = replica.info
        offset = time.monotonic() - info.clock if info is not None and info.hostname != _HOSTNAME else 0.0
        core_outputs = report.outputs
        if replica.role == "producer":
            core_outputs = self.handoffs.from_producer(index, core_outputs)
        elif replica.role == "consumer":
            core_outputs = self.handoffs.from_consumer(core_outputs)
        for sync in report.syncs:
            if replica.role == "producer" and sync.request_id in self.handoffs:
                continue  # the decode engine's timestamps are the request's
            request = self.output_processor.request(sync.request_id)
            if request is not None:
                sync.apply(request, offset)
        if report.kv_loaded:
            for transfer in self.handoffs.kv_loaded(report.kv_loaded):
                for listener in self.transfer_listeners:
                    listener(*transfer)
        if report.failed and replica.role == "consumer":
            self.handoffs.release_kv(report.failed)
        if report.kv_failed:
            self._prefill_on_consumer(report.kv_failed, replica)
        outputs, stopped = self.output_processor.process(core_outputs)
        if stopped:
            self._send_each("finish", stopped)
        # a request that cannot go on fails its stream with the reason instead of ending with what it wrote
        errors = {out.request_id: out.error or "the request failed" for out in core_outputs
                  if out.finish_reason == "error"}
        failed_parents = {self._parents.get(child_id) for child_id in errors}
        for output in outputs:
            queue = self._queues.get(output.request_id)
            if queue is not None and output.request_id not in failed_parents:
                queue.put_nowait(output)
        for child_id, error in errors.items():
            self._fail_requests([child_id], EngineStepError(error))
        if report.failed:
            self._fail_requests(report.failed, EngineStepError(report.error or "the model step failed"))
        if report.rejected:
            self._fail_requests(report.rejected, ValueError(report.rejected_error or "rejected by the engine"))
        load = self._loads[index]
        load.acknowledge(report.acked, report.waiting, report.load_tokens)
        for router in self._routers():
            router.apply_events(index, report.kv_events)
            router.set_load(index, load.total_tokens())
        if replica.role == "producer":
            for pending_listener in self.pending_kv_listeners:
                pending_listener(index, report.kv_pending)
        if report.record is not None:
            for step_listener in self.step_listeners:
                step_listener(report.record, index)
        else:
            for state_listener in self.state_listeners:
                state_listener(report.running, report.waiting, report.kv_usage, index)

    def _replica_down(self, replica: Replica, reason: str) -> None:
        replica.state = "down"
        for router in self._routers():
            router.set_alive(replica.index, False)
        self._loads[replica.index] = _Load()
        children = [child for child, i in self._replica_of.items() if i == replica.index]
        for child in children:
            del self._replica_of[child]
        logger.error("engine core %d is down (%s): moving its %d requests", replica.index, reason, len(children))
        if replica.role == "consumer":
            self.handoffs.release_kv(children)
        self._migrate(children, replica, reason)
        for listener in self.replica_listeners:
            listener(replica)
        if replica.can_restart:
            task = asyncio.ensure_future(self._relaunch(replica))
            self._restarts.add(task)
            task.add_done_callback(self._restarts.discard)
        else:
            self._check_fatal(EngineDeadError(reason))

    def _migrate(self, child_ids: list[str], source: Replica, reason: str) -> None:
        """Resume a dead replica's unfinished requests elsewhere (engine/migration.py): on another live replica,
        or, held, on the next one to come up. Disaggregated, a dead prefill engine's prompts go to another
        prefill engine, or run on a decode engine when none is up; a dead decode engine's requests go to another
        decode engine, prompt and streamed tokens computed there."""
        groups, exhausted = self.migrations.take(child_ids)
        if exhausted:
            limit = self.migrations.limit
            self._fail_requests(exhausted, EngineDeadError(
                f"{reason}; the request was not moved again (moved {limit} time{'s' if limit > 1 else ''} already, "
                f"--migration-limit {limit})" if limit else reason))
        restartable = source.can_restart or any(r.state in ("starting", "restarting") for r in self.replicas)
        for children in groups.values():
            if source.role == "producer" and self.router.has_alive():
                target = self._submit(self.router, [prefill_copy(c) for c in children], children[0].prompt_token_ids)
                self.migrations.moved(children, source.index, target)
                continue
            colocated = self.disaggregated
            if colocated:
                self.handoffs.forget([c.request_id for c in children])  # no longer handed from engine to engine
            self._resume(HeldGroup(children, source.index, colocated), restartable, reason)

    def _prefill_on_consumer(self, child_ids: list[str], consumer: Replica) -> None:
        """A decode engine could not fetch these prompts' KV (their prefill engine died, or the transfer broke):
        they run on a decode engine from the prompt."""
        self.handoffs.forget(child_ids)
        for child_id in child_ids:
            self._replica_of.pop(child_id, None)
        groups, exhausted = self.migrations.take(child_ids)
        if exhausted:
            self._fail_requests(exhausted, EngineDeadError("the prompt's KV could not be fetched"))
        for children in groups.values():
            self._resume(HeldGroup(children, consumer.index, colocated=True), True,
                         "the prompt's KV could not be fetched")

    def _resume(self, group: HeldGroup, can_wait: bool, reason: str) -> None:
        """Send moved requests on to a live engine; with none up, hold them if one may come (`can_wait`), or fail
        them with `reason`."""
        if self._can_place(group.colocated):
            self._place(group, count=True)
        elif can_wait:
            self.migrations.moved(group.children, group.source, None)
            self.migrations.hold(group)
        else:
            self._fail_requests([c.request_id for c in group.children], EngineDeadError(reason))

    def _router_for(self, colocated: bool) -> Router:
        """Disaggregated, a request run colocated goes to a decode engine; otherwise the first router decides."""
        return self.decode_router if colocated and self.decode_router is not None else self.router

    def _can_place(self, colocated: bool) -> bool:
        return self._router_for(colocated).has_alive()

    def _place(self, group: HeldGroup, count: bool) -> None:
        target = self._submit(self._router_for(group.colocated), group.children, group.children[0].prompt_token_ids)
        if count:
            self.migrations.moved(group.children, group.source, target)
        else:
            logger.info("%d held requests went on to engine core %d", len(group.children), target)

    async def _relaunch(self, replica: Replica) -> None:
        replica.state = "restarting"
        replica.restarts += 1
        for listener in self.replica_listeners:
            listener(replica)
        for attempt in range(1, MAX_LAUNCH_ATTEMPTS + 1):
            try:
                started = time.monotonic()
                await asyncio.to_thread(replica.launch)
            except Exception as exc:  # noqa: BLE001 - logged; retried, then given up
                logger.error("relaunching engine core %d failed (attempt %d of %d): %s", replica.index, attempt,
                             MAX_LAUNCH_ATTEMPTS, exc)
                await asyncio.sleep(float(attempt))
                continue
            logger.info("engine core %d is back (pid %s, %.1f s)", replica.index, replica.pid,
                        time.monotonic() - started)
            self._start(replica)
            return
        replica.state = "failed"
        for listener in self.replica_listeners:
            listener(replica)
        self._check_fatal(EngineDeadError(f"engine core {replica.index} could not be restarted"))

    def _check_fatal(self, error: BaseException) -> None:
        if any(r.state in ("up", "restarting", "starting") for r in self.replicas):
            return
        self.dead_error = error
        self.migrations.held.clear()
        self.fail_all(error)
        for listener in self.fatal_listeners:
            listener(error)

    def _fail_requests(self, child_ids: list[str], exc: BaseException) -> None:
        """Hand `exc` to the streams owning these engine requests (a parent fails with any of its children)."""
        for request_id in {self._parents.get(child_id) for child_id in child_ids}:
            queue = self._queues.get(request_id) if request_id is not None else None
            if queue is not None:
                queue.put_nowait(exc)

    def fail_all(self, exc: BaseException) -> None:
        """Fail every open request stream with `exc` (closing a stream aborts its engine requests)."""
        for queue in self._queues.values():
            queue.put_nowait(exc)

    # ------------------------------------------------------------------ requests

    @property
    def num_open_requests(self) -> int:
        return len(self._queues)

    def num_waiting(self) -> int:
        return sum(load.total_waiting() for load in self._loads)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._queues

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams, priority: int = 0,
                    arrival_time: float | None = None, strict_max_tokens: bool = False,
                    lora_request: LoRARequest | None = None) -> RequestStream:
        """Validate, route and submit at once (raising QueueFullError / ValueError / EngineDeadError); the
        returned stream yields the outputs, and closing it before the end aborts the request."""
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine is not running: {self.dead_error}")
        if not self.is_running:
            raise EngineDeadError("no engine core is running (restarting)")
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        if self.num_waiting() >= self.max_waiting_requests:
            raise QueueFullError(f"the waiting queue is full ({self.max_waiting_requests} requests)")
        text, token_ids, children = self.processor.make_requests(
            request_id, prompt, params, time.monotonic() if arrival_time is None else arrival_time, priority,
            strict_max_tokens, lora_request)
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._queues[request_id] = queue
        self._parents.update((child.request_id, request_id) for child in children)
        self.output_processor.add(request_id, text, token_ids, children)
        if self.disaggregated and self.router.has_alive():  # the prompt runs on a prefill engine first
            self._submit(self.router, self.handoffs.start(children), token_ids)
        else:  # colocated; disaggregated with no prefill engine up, a decode engine runs it all
            self._submit(self._router_for(self.disaggregated), children, token_ids)
        return RequestStream(self, request_id, children, queue)

    def _submit(self, router: Router, children: list[Request], token_ids: list[int]) -> int:
        """Route and send engine requests (the samples of one prompt go together); returns the replica."""
        decision = router.route(token_ids)
        for listener in self.route_listeners:
            listener(decision)
        index = decision.replica
        self._replica_of.update((child.request_id, index) for child in children)
        seq = self.replicas[index].send("add", children)
        load = self._loads[index]
        load.unacked.append((seq, len(children), len(token_ids) * len(children)))
        for each in self._routers():
            each.set_load(index, load.total_tokens())
        return index

    def _submit_decode(self, request: Request) -> int:
        """Send a prompt done on a prefill engine on to a decode engine; with none up, it waits for one (-1)."""
        assert self.decode_router is not None
        if not self.decode_router.has_alive():
            self.migrations.hold(HeldGroup([request], -1, colocated=True))
            return -1
        return self._submit(self.decode_router, [request], request.prompt_token_ids)

    def _discard_later(self, path: str) -> None:
        """Remove a shared-memory KV file in case its producer could not, later and off the event loop: the
        producer normally removes it on release, and freeing a long prompt's pages takes the kernel
        milliseconds (9 ms for 69 MB here) that every stream's next token would wait for on this loop."""
        if self._loop is None or self._loop.is_closed():
            discard(path)
            return
        loop = self._loop
        loop.call_later(DISCARD_DELAY_S, lambda: loop.run_in_executor(None, discard, path))

    def _send_each(self, kind: str, child_ids: list[str]) -> None:
        """Send a command about engine requests to the replicas serving them now."""
        by_replica: dict[int, list[str]] = {}
        for child_id in child_ids:
            index = self._replica_of.get(child_id)
            if index is not None and self.replicas[index].state == "up":
                by_replica.setdefault(index, []).append(child_id)
        for index, ids in by_replica.items():
            self.replicas[index].send(kind, ids)

    async def generate(self, request_id: str, prompt: PromptType, params: SamplingParams,
                       priority: int = 0, lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        stream = self.add_request(request_id, prompt, params, priority, lora_request=lora_request)
        try:
            async for output in stream:
                yield output
        finally:
            stream.close()

    def _release(self, request_id: str, children: list[Request], finished: bool) -> None:
        self._queues.pop(request_id, None)
        for child in children:
            self._parents.pop(child.request_id, None)
        if not finished:
            self.abort(request_id, children)
        ids = [child.request_id for child in children]
        self.handoffs.forget(ids)
        self.migrations.forget(ids)
        for child_id in ids:
            self._replica_of.pop(child_id, None)

    def abort(self, request_id: str, children: list[Request] | None = None) -> None:
        ids = [c.request_id for c in children] if children else self.output_processor.child_ids(request_id)
        self.output_processor.abort(request_id)
        self._send_each("abort", ids)

    def replica_status(self) -> list[dict[str, Any]]:
        """One entry per replica for /health."""
        return [{"replica": r.index, "state": r.state, "pid": r.pid, "restarts": r.restarts}
                | ({"role": r.role} if r.role else {}) for r in self.replicas]


def launch_all(replicas: list[Replica]) -> None:
    """Launch the replicas side by side (each loads its own model copy), raising the first failure."""
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(len(replicas)) as pool:
        errors = [f.exception() for f in [pool.submit(r.launch) for r in replicas]]
    for error in errors:
        if error is not None:
            for replica in replicas:
                replica.stop(timeout=1.0)
            raise error


_HOSTNAME = socket.gethostname()
