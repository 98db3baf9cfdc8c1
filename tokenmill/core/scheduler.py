"""Iteration-level scheduler: one decision per model step under a token budget.

Every request is *computed tokens catching up with known tokens*. A decode needs one token, a prompt needs the
rest of its prompt (cut to the budget left: chunked prefill), a prefix-cache hit starts with computed tokens
already, and a preempted request drops back to zero (recompute, reusing whatever prefix is still cached).

Batching modes share this code: `continuous` admits waiting requests every step; `dynamic` admits a batch only
when the previous one has fully finished; `static` does the same and also reserves every request's maximum
KV up front and keeps finished rows in the batch, computing a padding token for them each step until the
batch's longest request ends (as a padded static batch does).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence

from tokenmill.config import LONG_ROPE_CACHE_KEY, EngineConfig
from tokenmill.core.grammar_waits import GrammarWaits
from tokenmill.core.kv_cache_manager import KVCacheManager, PrefixHit
from tokenmill.core.lora_waits import AdapterSource, LoRAWaits
from tokenmill.core.outputs import (
    EngineCoreOutput,
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
    SchedulerStats,
)
from tokenmill.core.prompt_order import ShortestPromptFirst, remaining_prompt
from tokenmill.core.remote_kv import RemoteKVLoads
from tokenmill.core.request_queue import FCFSQueue, PriorityQueue, RequestQueue
from tokenmill.core.spec_counts import SpecDecodeCounts
from tokenmill.core.tier_loads import TierLoads
from tokenmill.core.token_budget import TokenBudget
from tokenmill.request import Request, RequestStatus
from tokenmill.structured_output.backend import Grammar
from tokenmill.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


def check_request_fits(request: Request, max_model_len: int, kv_capacity_tokens: int, static_batching: bool) -> None:
    """Reject what can never run (ValueError); set the request's length limit."""
    prompt_len = request.num_prompt_tokens
    room = 0 if request.sampling_params.pool else 1  # an embedding samples nothing: its input may fill the context
    if prompt_len + room > max_model_len:
        raise ValueError(
            f"this model's maximum context length is {max_model_len} tokens; the prompt has "
            f"{prompt_len} tokens" + ("" if request.sampling_params.pool else " and leaves no room for a completion")
        )
    # A sequence can never outgrow the whole KV pool: that caps its length like the context limit does.
    max_tokens = request.sampling_params.max_tokens
    limit = min(max_model_len, kv_capacity_tokens)
    if max_tokens is not None:
        limit = min(limit, prompt_len + max_tokens)
    static_need = prompt_len + (max_tokens or 0) if static_batching else 0
    if prompt_len + room > kv_capacity_tokens or static_need > kv_capacity_tokens:
        raise ValueError(f"request needs more KV cache than the whole pool holds ({kv_capacity_tokens} tokens)")
    request.max_total_tokens = limit


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager, max_model_len: int,
                 clock: Callable[[], float] = time.monotonic,
                 structured_output: StructuredOutputManager | None = None,
                 reasoning_tags: tuple[Sequence[int], Sequence[int]] | None = None,
                 adapters: AdapterSource | None = None, long_rope_threshold: int | None = None) -> None:
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < max_model_len:
            raise ValueError(f"without chunked prefill, max_num_batched_tokens ({config.max_num_batched_tokens}) "
                             f"must hold the longest prompt: at least max_model_len ({max_model_len})")
        self.config = config
        self.grammars = GrammarWaits(structured_output, reasoning_tags)
        self.loras = LoRAWaits(adapters, config.max_loras)
        # longrope (Phi-3.5, Phi-4-mini): a sequence that grows past this length is computed again with the long
        # factors, as transformers' Phi-3 recomputes its cache then (Phi3ForCausalLM.prepare_inputs_for_generation)
        self.long_rope_threshold = long_rope_threshold
        self.kv = kv
        self.max_model_len = max_model_len
        self.clock = clock
        self.waiting: RequestQueue = (
            PriorityQueue(config.priority_aging_per_s) if config.policy == "priority" else FCFSQueue()
        )
        self.running: list[Request] = []
        self.padding_rows: list[Request] = []  # static mode: finished rows still holding their slot
        self.requests: dict[str, Request] = {}
        self._finished_since_plan: list[str] = []
        self._outputs_since_plan: list[EngineCoreOutput] = []  # requests the core ended outside a step's update
        self.total_preemptions = 0
        self.spec = SpecDecodeCounts()  # speculative decoding: verifications since the start
        self.token_budget = None if config.target_itl_ms is None else TokenBudget(
            config.target_itl_ms / 1e3, config.max_num_batched_tokens)
        self.prompt_order = None if config.target_itl_ms is None else ShortestPromptFirst(
            config.max_num_batched_tokens)
        self.last_stats = SchedulerStats()
        # Disaggregation hooks, set by the engine core: a request about to free its blocks (a producer saves its
        # prompt's KV), and the requests admitted with remote KV (a consumer loads it into their blocks).
        self.finish_hook: Callable[[Request], None] | None = None
        self.remote_kv: RemoteKVLoads | None = None  # a consumer's requests whose KV is arriving
        self.tier_loads: TierLoads | None = None  # requests whose prefix the KV tiers are reading back

    # ------------------------------------------------------------------ requests in and out

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.check_request(request)
        self.loras.add(request)
        self.grammars.add(request)
        self.requests[request.request_id] = request
        self.waiting.push(request)

    def check_request(self, request: Request) -> None:
        """Reject what can never run (ValueError); set the request's length limit. Safe from any thread."""
        check_request_fits(request, self.max_model_len, self.kv.num_blocks * self.kv.block_size,
                           self.config.batching == "static")

    def abort_requests(self, request_ids: Iterable[str]) -> list[str]:
        """Abort in any state (a static batch's slot is released at once); returns the ids still unfinished."""
        return self._end(request_ids, RequestStatus.FINISHED_ABORTED, keep_slot=False)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[str]:
        """Finish requests for a reason found outside the core (a stop string in the detokenized text)."""
        return self._end(request_ids, status, keep_slot=True)

    def _end(self, request_ids: Iterable[str], status: RequestStatus, keep_slot: bool) -> list[str]:
        ended = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            if request_id in self.loading:  # its KV is being written: the blocks go when the load is done
                request.status = status
                request.times.finished = self.clock()
                del self.requests[request_id]
                self._finished_since_plan.append(request_id)
            else:
                if request.status == RequestStatus.RUNNING:
                    self.running.remove(request)
                else:
                    self.waiting.remove(request)
                self._finish(request, status, keep_slot)
            ended.append(request_id)
        return ended

    def _finish(self, request: Request, status: RequestStatus, keep_slot: bool = True) -> None:
        request.status = status
        request.times.finished = self.clock()
        if self.finish_hook is not None and request.kv_transfer_params is not None:
            self.finish_hook(request)
        if self.config.batching == "static" and keep_slot and request.request_id in self.kv.req_blocks:
            self.padding_rows.append(request)
        else:
            self.kv.free(request.request_id)
        del self.requests[request.request_id]
        self._finished_since_plan.append(request.request_id)
        if self.padding_rows and not self.running:  # the static batch is over: release its slots
            for row in self.padding_rows:
                self.kv.free(row.request_id)
            self.padding_rows.clear()

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or len(self.waiting) or self.loading)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ------------------------------------------------------------------ one step

    def schedule(self) -> SchedulerOutput:
        if self.loading:
            self._start_loaded()
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        preempted: list[Request] = []
        # Static mode: finished rows of the batch still run (outside the token budget, as the padded rows of a
        # fixed-size batch do: the batch size, not the budget, bounds them).
        padding = list(self.padding_rows)

        # 1. Running requests: decodes first, so prompt work can never starve them.
        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens <= 1]
        prompts = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        budget = self._schedule_in_order(decodes, budget, num_scheduled, preempted)

        # 2. Prompts: the running ones, then the waiting ones in policy order while budget, sequence slots and
        # blocks last; those whose grammar is still compiling step aside without holding up the others.
        budget = self._prompt_budget(num_scheduled, budget, prompts[0].num_computed_tokens if prompts else 0)
        if preempted:
            self._schedule_in_order(prompts, budget, num_scheduled, preempted)
        else:
            # their grammar failed to compile, or their adapter to load
            failed = self.grammars.set_aside(self.waiting) + self.loras.set_aside(self.waiting)
            for request in failed:
                self._finish(request, RequestStatus.FINISHED_ABORTED, keep_slot=False)
                self._outputs_since_plan.append(EngineCoreOutput(request.request_id, [], finish_reason="abort"))
            if self.prompt_order is not None and self.config.batching == "continuous":
                self._schedule_prompts_shortest_first(prompts, budget, num_scheduled, preempted)
            else:
                budget = self._schedule_in_order(prompts, budget, num_scheduled, preempted)
                if not preempted:
                    self._admit_waiting(budget, num_scheduled)
            self.loras.restore(self.waiting)
            self.grammars.restore(self.waiting)

        return self._build_plan(num_scheduled, padding, preempted)

    def _schedule_running(self, request: Request, budget: int, num_scheduled: dict[str, int],
                          preempted: list[Request]) -> int:
        """Its next tokens (a decode, its proposals, or a prompt chunk), preempting later requests when the KV
        pool is full; returns the budget left."""
        if request.status != RequestStatus.RUNNING:  # preempted earlier in this step
            return budget
        self.grammars.trim_proposals(request)
        self._trim_before_long_rope(request)
        num_new = min(request.num_tokens - request.num_computed_tokens + len(request.spec_token_ids), budget)
        if num_new <= 0:
            return budget
        if request.spec_token_ids and self.kv.allocate_slots(request, num_new) is None:
            # proposals are a bet: never preempt anyone to make room for them
            request.spec_token_ids = []
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
        while self.kv.allocate_slots(request, num_new) is None:
            victim = self._pick_victim(request)
            if victim.request_id in num_scheduled:
                budget += num_scheduled.pop(victim.request_id)
            self._preempt(victim)
            preempted.append(victim)
            if victim is request:
                break
        if request.status == RequestStatus.RUNNING:
            num_scheduled[request.request_id] = num_new
            budget -= num_new
        return budget

    def _schedule_in_order(self, requests: list[Request], budget: int, num_scheduled: dict[str, int],
                           preempted: list[Request]) -> int:
        """Running requests one after the other while budget lasts; returns the budget left."""
        for request in requests:
            if budget == 0:
                break
            budget = self._schedule_running(request, budget, num_scheduled, preempted)
        return budget

    def _schedule_prompts_shortest_first(self, prompts: list[Request], budget: int, num_scheduled: dict[str, int],
                                         preempted: list[Request]) -> None:
        """--target-itl-ms: running and waiting prompts share the budget shortest remaining first, within the
        bound on passing (core/prompt_order.py)."""
        assert self.prompt_order is not None
        candidates = prompts + list(self.waiting)
        ordered = self.prompt_order.order(candidates)
        running = {r.request_id for r in prompts}
        admitting = True  # until a waiting request cannot start (slots, blocks): none after it may
        partial = len(prompts)  # prompts left partway (counting every running one: an upper bound)
        for request in ordered:
            if budget == 0:
                break
            if request.request_id in running:
                budget = self._schedule_running(request, budget, num_scheduled, preempted)
                admitting = admitting and not preempted  # the pool is full: no one else starts this step
            elif admitting:
                if remaining_prompt(request) > budget and partial >= self.config.max_num_partial_prefills:
                    admitting = False
                    continue
                budget = self._admit_waiting(budget, num_scheduled, [request])
                if request.status == RequestStatus.RUNNING or request.request_id in self.loading:
                    if request.num_computed_tokens + num_scheduled.get(request.request_id, 0) < request.num_tokens:
                        partial += 1
                else:  # no slot or block for it (an adapter over max_loras only steps aside)
                    admitting = not self.loras.admits(request, self.running)
        self.prompt_order.charge(candidates, ordered, num_scheduled)

    def _trim_before_long_rope(self, request: Request) -> None:
        """Proposals never reach past the original context before the crossing: the rows there would read KV
        rotated with the short factors, which the crossing recomputes."""
        threshold = self.long_rope_threshold
        if threshold is not None and request.spec_token_ids and not request.rope_length:
            request.spec_token_ids = request.spec_token_ids[:max(0, threshold - request.num_tokens)]

    def _restart_with_long_rope(self, request: Request) -> None:
        """The sequence just grew past longrope's original context: compute it again from the start with the long
        factors (a recompute into fresh blocks: its blocks may be shared, and their short-factor KV stays valid in
        the prefix cache for the prompts that do not cross). Its new blocks get the long-rope salt."""
        assert self.long_rope_threshold is not None
        request.rope_length = self.long_rope_threshold + 1
        request.set_cache_salt(LONG_ROPE_CACHE_KEY)
        request.block_hashes = []
        self._recompute_later(request)

    def _prompt_budget(self, decodes: dict[str, int], budget: int, next_prompt_start: int) -> int:
        """The tokens left for prompt chunks once the decodes (all scheduled so far) are in: the fixed budget's
        rest, or with --target-itl-ms what keeps the step within the target."""
        if self.token_budget is None:
            return budget
        rows = [(n, self.requests[request_id].num_computed_tokens) for request_id, n in decodes.items()]
        return min(self.token_budget.prompt_tokens(rows, next_prompt_start), budget)  # the cap holds too

    def _admit_waiting(self, budget: int, num_scheduled: dict[str, int],
                       candidates: list[Request] | None = None) -> int:
        """Start waiting requests (`candidates`, else the whole queue in policy order) while budget, sequence
        slots and blocks last; returns the budget left."""
        mode = self.config.batching
        if mode != "continuous":
            if self.running or self.padding_rows:
                return budget
            return self._form_batch(budget, num_scheduled)
        partial = sum(1 for r in self.running
                      if r.request_id in num_scheduled
                      and r.num_computed_tokens + num_scheduled[r.request_id] < r.num_tokens)
        for request in list(self.waiting) if candidates is None else candidates:
            if budget <= 0 or len(self.running) + len(self.loading) >= self.config.max_num_seqs:
                break
            if not self.loras.admits(request, self.running):
                continue  # its adapter would exceed max_loras: the requests behind it go first
            hit = self.kv.find_cached_prefix(request)
            remote = request.kv_transfer_params is not None and self.remote_kv is not None
            if self.tier_loads is not None:  # the prefix goes on in the KV tiers under the pool
                loading = self.tier_loads.admit(request, hit, whole_prompt=remote)
                if loading is False:
                    break
                if loading:
                    self.waiting.remove(request)
                    continue
            if remote:
                assert self.remote_kv is not None
                if not self.remote_kv.admit(request, hit):
                    break
                self.waiting.remove(request)
                continue
            num_new = request.num_tokens - hit.num_tokens
            if num_new > budget:
                if partial >= self.config.max_num_partial_prefills or not self.config.enable_chunked_prefill:
                    break
                num_new = budget
                partial += 1
            if self.kv.allocate_slots(request, num_new, hit) is None:
                break
            self.waiting.remove(request)
            self._start_running(request, hit)
            num_scheduled[request.request_id] = num_new
            budget -= num_new
        return budget

    @property
    def loading(self) -> dict[str, tuple[Request, PrefixHit]]:
        remote = self.remote_kv.loading if self.remote_kv is not None else None
        tiers = self.tier_loads.loading if self.tier_loads is not None else None
        if remote is not None and tiers is not None:  # a consumer with tiers: both kinds (a copy)
            return remote | tiers
        return remote if remote is not None else tiers if tiers is not None else {}

    def _start_loaded(self) -> None:
        """Requests whose KV has arrived start running. From the KV tiers: from the first token they lacked.
        Remote KV: computing only the last prompt token, which samples the first output token here (as in vLLM's
        disaggregation: the producer's own token is dropped, so sampling, seeds included, happens where it would
        colocated); a failed load ends its request with the error."""
        if self.tier_loads is not None:
            for request, hit in self.tier_loads.finished():
                if request.kv_transfer_params is not None and self.remote_kv is not None:
                    self.remote_kv.fetch_rest(request, hit)  # a decode engine's: the producer sends the rest
                else:
                    self._start_running(request, hit)
        if self.remote_kv is None:
            return
        ready, failed = self.remote_kv.finished()
        for request in failed:
            request.status = RequestStatus.FINISHED_ABORTED
            request.times.finished = self.clock()
            del self.requests[request.request_id]
            self._finished_since_plan.append(request.request_id)
        for request, hit in ready:
            self._start_running(request, hit)
            request.num_computed_tokens = max(request.num_tokens - 1, hit.num_tokens)

    def _form_batch(self, budget: int, num_scheduled: dict[str, int]) -> int:
        """Dynamic/static: take up to max_num_seqs waiting requests as the next batch."""
        static = self.config.batching == "static"
        while len(self.waiting) and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek()
            if not self.loras.admits(request, self.running):  # the batch is full of adapters: it closes
                break
            hit = self.kv.find_cached_prefix(request)
            reserve = request.max_total_tokens if static else 0
            if request.num_tokens - hit.num_tokens > budget and not self.config.enable_chunked_prefill:
                break
            num_new = min(request.num_tokens - hit.num_tokens, budget)
            if self.kv.allocate_slots(request, num_new, hit, reserve_tokens=reserve) is None:
                break
            self.waiting.pop()
            self._start_running(request, hit)
            if num_new:
                num_scheduled[request.request_id] = num_new
                budget -= num_new
        return budget

    def _start_running(self, request: Request, hit: PrefixHit) -> None:
        now = self.clock()
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = hit.num_tokens
        if request.status == RequestStatus.PREEMPTED:
            request.num_recomputed_tokens += max(0, request.num_tokens - 1 - hit.num_tokens)
            request.resumed_without_progress = True
        self.kv.record_prefix_query(request.num_tokens, hit.num_tokens)
        request.num_computed_tokens = hit.num_tokens
        request.status = RequestStatus.RUNNING
        if request.times.first_scheduled is None:
            request.times.first_scheduled = now
        self.running.append(request)

    def _pick_victim(self, request: Request) -> Request:
        """Lowest priority, then latest arrival. A request just resumed from preemption is spared until it
        makes progress (no thrash) unless nothing else is left."""
        candidates = [r for r in self.running if not r.resumed_without_progress or r is request]
        if not candidates:
            candidates = self.running
        if self.config.policy == "priority":
            queue = self.waiting
            assert isinstance(queue, PriorityQueue)
            return max(candidates, key=lambda r: (queue.key(r), r.times.arrival))
        return max(candidates, key=lambda r: r.times.arrival)

    def _preempt(self, request: Request) -> None:
        request.num_preemptions += 1
        self.total_preemptions += 1
        self._recompute_later(request)

    def _recompute_later(self, request: Request) -> None:
        """Out of the running batch, its blocks freed, back at the queue's front to be computed from the start
        (reusing whatever of its prefix the cache still holds)."""
        self.running.remove(request)
        self.kv.free(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        self.waiting.push_front(request)

    def _build_plan(self, num_scheduled: dict[str, int], padding: list[Request],
                    preempted: list[Request]) -> SchedulerOutput:
        scheduled = []
        grammar_rows: list[tuple[Grammar, Sequence[int]]] = []
        prefill_tokens = decode_tokens = 0
        for request in self.running:
            num_new = num_scheduled.get(request.request_id, 0)
            if not num_new:
                continue
            start = request.num_computed_tokens
            # proposed tokens ride after the known ones, as far as the budget let them
            num_spec = max(0, start + num_new - request.num_tokens)
            sample = start + num_new >= request.num_tokens
            grammar = self.grammars.active_grammar(request)
            if grammar is not None and sample:
                grammar_rows.append((grammar, request.spec_token_ids[:num_spec]))
            scheduled.append(ScheduledRequest(
                request_id=request.request_id,
                token_ids=request.all_token_ids[start:start + num_new] + request.spec_token_ids[:num_spec],
                start_position=start,
                block_table=self.kv.block_table(request.request_id),
                sample=sample,
                sampling_params=request.sampling_params,
                prompt_token_ids=request.prompt_token_ids,
                output_token_ids=request.output_token_ids,
                banned_token_ids=self._banned_tokens(request),
                num_spec_tokens=num_spec,
                structured=grammar is not None,
                score_prompt=request.needs_prompt_logprobs,
                lora_request=request.lora_request,
                rope_length=request.rope_length,
                token_type_ids=None if request.token_type_ids is None
                else request.token_type_ids[start:start + num_new],
            ))
            if start >= request.num_prompt_tokens:
                decode_tokens += num_new
            else:
                prefill_tokens += num_new
            request.num_computed_tokens += num_new
        for request in padding:
            last = request.num_tokens - 1
            scheduled.append(ScheduledRequest(
                request_id=request.request_id, token_ids=[request.all_token_ids[last]], start_position=last,
                block_table=self.kv.block_table(request.request_id), sample=False,
                sampling_params=request.sampling_params, prompt_token_ids=request.prompt_token_ids,
                output_token_ids=request.output_token_ids, padding=True, lora_request=request.lora_request,
            ))
        finished, self._finished_since_plan = self._finished_since_plan, []
        plan = SchedulerOutput(scheduled, prefill_tokens, decode_tokens,
                               [r.request_id for r in preempted], finished, planned_at=self.clock())
        if grammar_rows:
            plan.grammar_bitmask = self.grammars.grammar_bitmask(grammar_rows)
        self.last_stats = self._stats(plan, len(padding), len(preempted))
        return plan

    @staticmethod
    def _banned_tokens(request: Request) -> list[int]:
        """Before min_tokens, EOS and stop token ids cannot be sampled (vLLM's min_tokens semantics)."""
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            return []
        eos = [] if params.ignore_eos else list(request.eos_token_ids)
        return eos + list(params.stop_token_ids)

    def _stats(self, plan: SchedulerOutput, num_padding: int, num_preempted: int) -> SchedulerStats:
        kv_tokens = sum(r.num_computed_tokens for r in self.running)
        reserved = sum(self.kv.num_allocated_blocks(r.request_id) for r in self.running + self.padding_rows)
        return SchedulerStats(
            num_running=len(self.running), num_waiting=len(self.waiting), kv_usage=self.kv.usage(),
            kv_tokens=kv_tokens, kv_reserved_tokens=reserved * self.kv.block_size,
            num_prefill_tokens=plan.num_prefill_tokens, num_decode_tokens=plan.num_decode_tokens,
            num_padding_tokens=num_padding, num_preemptions=num_preempted,
            prefix_queries=self.kv.prefix_queries, prefix_hits=self.kv.prefix_hits,
            prompt_budget=self.token_budget.last_prompt_budget if self.token_budget else None,
            **self.loras.stats(self.running, self.waiting),
        )

    # ------------------------------------------------------------------ after the step

    def update(self, plan: SchedulerOutput, output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        now = self.clock()
        outputs, self._outputs_since_plan = self._outputs_since_plan, []
        stats = self.last_stats
        for request_id, (position, entries) in output.prompt_logprobs.items():
            request = self.requests.get(request_id)
            if request is not None:
                # a prompt computed again (after preemption) is scored again: keep the entries once
                known = len(request.prompt_logprobs)
                if position <= known + 1:
                    request.prompt_logprobs.extend(entries[known + 1 - position:])
        for scheduled in plan.scheduled:
            request = self.requests.get(scheduled.request_id)
            if request is not None and not scheduled.padding and scheduled.start_position < request.num_prompt_tokens:
                request.times.prefill_chunks.append((plan.planned_at, now, scheduled.num_tokens))
            if not scheduled.sample or scheduled.padding:
                continue
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            if request.sampling_params.pool:  # an embedding: its prompt is done, so is the request
                request.times.first_token = request.times.last_token = now
                self.running.remove(request)
                self._finish(request, RequestStatus.FINISHED_STOPPED)
                outputs.append(EngineCoreOutput(request.request_id, [], finish_reason="stop",
                                                pooled=output.pooled.get(request.request_id)))
                continue
            accepted = output.accepted_token_ids.get(scheduled.request_id, [])
            tokens = accepted + [output.sampled_token_ids[scheduled.request_id]]
            logprob_list = output.accepted_logprobs.get(scheduled.request_id, [])
            last_logprobs = output.logprobs.get(scheduled.request_id)
            if last_logprobs is not None:
                logprob_list = logprob_list + [last_logprobs]
            if scheduled.num_spec_tokens:
                # the KV of rejected proposals is stale: those positions get computed again
                request.num_computed_tokens -= scheduled.num_spec_tokens - len(accepted)
                self.spec.record(request, scheduled.num_spec_tokens, len(accepted), stats)
            request.spec_token_ids = []
            request.resumed_without_progress = False
            times = request.times
            if times.first_token is None:
                times.first_token = now
            times.last_token = now
            out = EngineCoreOutput(request.request_id, [])
            if not request.output_token_ids and request.sampling_params.prompt_logprobs is not None:
                out.prompt_logprobs = request.prompt_logprobs  # complete with the prompt: sent with its first token
            for i, token in enumerate(tokens):  # stop at the first token that ends the request
                request.append_output_token(token)
                if i < len(logprob_list):
                    request.logprobs.append(logprob_list[i])
                    out.new_logprobs.append(logprob_list[i])
                times.token_times.append(now)
                out.new_token_ids.append(token)
                status = self._check_stop(request, token)
                if status is None and request.structured is not None:
                    status = self.grammars.advance(request, token)
                if status is not None:
                    self.running.remove(request)
                    self._finish(request, status)
                    out.finish_reason = status.finish_reason
                    out.stop_reason = request.stop_reason
                    out.error = request.error
                    break
            outputs.append(out)
            threshold = self.long_rope_threshold
            if (threshold is not None and not request.rope_length and request.status == RequestStatus.RUNNING
                    and request.num_prompt_tokens <= threshold < request.num_tokens):
                self._restart_with_long_rope(request)
        return outputs

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if request.num_tokens >= request.max_total_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        owners = set(self.kv.req_blocks)
        expected = ({r.request_id for r in self.running} | {r.request_id for r in self.padding_rows}
                    | set(self.loading))
        if not owners <= expected:
            raise AssertionError(f"blocks held by requests that are not running: {owners - expected}")
