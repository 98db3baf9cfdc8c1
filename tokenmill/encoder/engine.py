"""The embedding engine of an encoder: requests of one or more inputs, each input a prompt-only request
(SamplingParams.pool) that the engine's Scheduler admits whole under the token budget and the sequence cap
(chunked prefill off: an encoder attends both ways, so an input runs in one step), batched across requests and
run by the EncoderRunner behind the Executor interface, pooled and normalised.

`submit` queues a request and returns a future; one worker thread steps the engine core (schedule -> execute ->
update) while any input is open, taking new requests in between steps. This is the offline engine
(`LLM(task="embed")`'s `embed` / `score`); a server runs the same core in engine-core processes (encoder/loader.py).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tokenmill.config import EngineConfig
from tokenmill.core.outputs import EngineCoreOutput
from tokenmill.encoder.config import EncoderConfig, Pooling
from tokenmill.encoder.front import TextOrTokens
from tokenmill.encoder.inputs import EncoderInput
from tokenmill.encoder.loader import encoder_core, load_encoder
from tokenmill.engine.core import ModelStepError
from tokenmill.request import Request
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class EmbedJob:
    inputs: list[EncoderInput]
    classify: bool = False  # a cross-encoder's scores instead of embeddings
    future: Future[torch.Tensor] = field(default_factory=Future)
    rows: list[list[float] | None] = field(default_factory=list)  # each input's vector, as the engine ends it

    @property
    def num_tokens(self) -> int:
        return sum(len(i.token_ids) for i in self.inputs)


@dataclass
class EmbeddingStats:
    requests: int = 0
    inputs: int = 0
    tokens: int = 0
    batches: int = 0  # engine steps that ran inputs
    seconds: float = 0.0


class EmbeddingEngine:
    def __init__(self, config: EngineConfig) -> None:
        loaded = load_encoder(config)
        front = loaded.front
        self.front = front
        self.config: EncoderConfig = front.config
        self.pooling: Pooling = front.pooling
        self.normalize = front.normalize
        self.tokenizer = front.tokenizer
        self.max_model_len = front.max_model_len
        self.core = encoder_core(config, loaded)
        self.stats = EmbeddingStats()
        self._jobs: queue.SimpleQueue[EmbedJob | None] = queue.SimpleQueue()
        self._open: dict[str, tuple[EmbedJob, int]] = {}  # engine request id -> (its job, its input's index)
        self._ids = itertools.count()
        self._worker: threading.Thread | None = None
        self._lock = threading.Lock()

    def make_input(self, text: TextOrTokens, pair: str | None = None,
                   truncate_prompt_tokens: int | None = None) -> EncoderInput:
        """Tokenize one input (token ids are taken as they are); ValueError for an empty or over-long one."""
        return self.front.make_input(text, pair, truncate_prompt_tokens)

    # ------------------------------------------------------------------ serving

    def start(self) -> None:
        with self._lock:
            self._start_locked()

    def _start_locked(self) -> None:
        if self._worker is None:
            self._worker = threading.Thread(target=self._run, name="tokenmill-embed", daemon=True)
            self._worker.start()

    def shutdown(self) -> None:
        """Stop the worker; requests still open fail (a later submit starts a new one)."""
        with self._lock:
            if self._worker is not None:
                self._jobs.put(None)
                self._worker.join()
                self._worker = None

    def submit(self, inputs: list[EncoderInput], classify: bool = False) -> Future[torch.Tensor]:
        """Queue a request: its future gives [inputs, hidden] pooled (normalised) embeddings, or [inputs, labels]
        cross-encoder logits with `classify`."""
        if not inputs:
            raise ValueError("no input given")
        if classify and not self.config.is_cross_encoder:
            raise ValueError("this model has no classification head (not a cross-encoder)")
        job = EmbedJob(inputs, classify)
        with self._lock:  # never between a shutdown's stop and its worker's exit: the job would wait for no one
            self._start_locked()
            self._jobs.put(job)
        return job.future

    def embed(self, texts: Sequence[TextOrTokens], truncate_prompt_tokens: int | None = None) -> torch.Tensor:
        return self.submit([self.make_input(t, truncate_prompt_tokens=truncate_prompt_tokens)
                            for t in texts]).result()

    def _run(self) -> None:
        """Take what was submitted (waiting for it while idle), then one engine step; until shut down."""
        while True:
            try:
                if not self._take_jobs():
                    return
                self._step()
            except Exception as exc:  # whatever broke, no future waits forever: the open requests fail
                logger.exception("the embedding engine's loop failed; failing its open requests")
                self._fail_jobs(exc)

    def _take_jobs(self) -> bool:
        """Add what was submitted, waiting for something while idle; False once shut down."""
        wait = not self.core.has_unfinished_requests()
        while True:
            try:
                job = self._jobs.get(block=wait)
            except queue.Empty:
                return True
            if job is None:
                self._fail_open(RuntimeError("the embedding engine stopped"))
                return False
            self._add(job)
            wait = False

    def _step(self) -> None:
        core = self.core
        if not core.has_unfinished_requests():
            return
        started = time.perf_counter()
        try:
            outputs = core.step()
        except ModelStepError as exc:  # the step's requests fail; the engine and the other requests go on
            logger.error("embedding step failed", exc_info=exc.__cause__)
            failed = set(core.fail_step(exc.plan))
            for job in {id(job): job for rid, (job, _) in self._open.items() if rid in failed}.values():
                self._fail(job, exc.__cause__ or exc)
            return
        record = core.last_step
        if record is not None and record.plan is not None and record.plan.scheduled:
            self.stats.batches += 1
            self.stats.seconds += time.perf_counter() - started
        for output in outputs:
            self._collect(output)

    def _add(self, job: EmbedJob) -> None:
        """Each input of `job` as an engine request; a job the scheduler refuses fails whole."""
        job_id = next(self._ids)
        params = SamplingParams(max_tokens=1, temperature=0.0, pool=True,
                                pooling_task="classify" if job.classify else "embed")
        job.rows = [None] * len(job.inputs)
        try:
            for i, item in enumerate(job.inputs):
                request = Request(f"embd-{job_id}-{i}", item.token_ids, params)
                request.token_type_ids = item.token_type_ids
                self.core.add_request(request)
                self._open[request.request_id] = (job, i)
        except ValueError as exc:
            self._fail(job, exc)

    def _collect(self, output: EngineCoreOutput) -> None:
        entry = self._open.pop(output.request_id, None)
        if entry is None:
            return
        job, index = entry
        if output.pooled is None:
            self._fail(job, RuntimeError(output.error or f"an input ended without a result ({output.finish_reason})"))
            return
        job.rows[index] = output.pooled
        if any(row is None for row in job.rows):
            return
        vectors = torch.tensor(job.rows, dtype=torch.float32)
        if self.normalize and not job.classify:
            vectors = F.normalize(vectors, dim=-1)
        job.future.set_result(vectors)
        stats = self.stats
        stats.requests += 1
        stats.inputs += len(job.inputs)
        stats.tokens += job.num_tokens

    def _fail(self, job: EmbedJob, exc: BaseException) -> None:
        """End `job` with `exc`; the engine drops its inputs still open."""
        ids = [rid for rid, (open_job, _) in self._open.items() if open_job is job]
        for rid in ids:
            del self._open[rid]
        self.core.abort_requests(ids)
        if not job.future.done():
            job.future.set_exception(exc)

    def _fail_jobs(self, exc: BaseException) -> None:
        for job in {id(job): job for job, _ in self._open.values()}.values():
            self._fail(job, exc)

    def _fail_open(self, exc: BaseException) -> None:
        self._fail_jobs(exc)
        while True:  # and what was queued behind the stop
            try:
                queued = self._jobs.get_nowait()
            except queue.Empty:
                return
            if queued is not None and not queued.future.done():
                queued.future.set_exception(exc)
