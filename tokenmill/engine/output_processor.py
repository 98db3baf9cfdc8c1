"""Front half of the engine: detokenization, stop strings, n>1 fan-in, and RequestOutput objects.

Kept apart from the core so that (as in vLLM v1) text work can run beside the model loop rather than in it.
Streaming holds back the last `len(longest stop string) - 1` characters until they cannot start a stop string,
so a stop string never leaks into a stream.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.core.outputs import EngineCoreOutput
from tokenmill.model.tokenizer import IncrementalDetokenizer, Tokenizer
from tokenmill.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tokenmill.request import Request


@dataclass
class _Completion:
    index: int
    request: Request
    detokenizer: IncrementalDetokenizer
    text: str = ""
    emitted: int = 0  # characters already handed out as deltas
    tokens_emitted: int = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class Progress:
    """An unfinished engine request as its client has seen it: the tokens (and their logprobs) streamed so far
    and the prompt logprobs, if they have arrived."""

    request: Request  # the front end's copy
    parent_id: str  # the client request it belongs to
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    prompt_logprobs: list[dict[int, float] | None] | None  # entries for prompt tokens 1..


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[_Completion]
    prompt_logprobs: list[dict[int, float] | None] | None = None
    pooled: list[float] | None = None

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.children)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._parents: dict[str, _Parent] = {}
        self._child_to_parent: dict[str, tuple[_Parent, _Completion]] = {}

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
            children: list[Request]) -> None:
        completions = [
            _Completion(i, child, IncrementalDetokenizer(self.tokenizer, child.sampling_params.skip_special_tokens),
                        logprobs=[] if child.sampling_params.logprobs is not None else None,
                        cumulative_logprob=0.0 if child.sampling_params.logprobs is not None else None)
            for i, child in enumerate(children)
        ]
        parent = _Parent(request_id, prompt, prompt_token_ids, completions)
        self._parents[request_id] = parent
        for completion in completions:
            self._child_to_parent[completion.request.request_id] = (parent, completion)

    def request(self, child_id: str) -> Request | None:
        """The front end's copy of an unfinished engine request."""
        entry = self._child_to_parent.get(child_id)
        return entry[1].request if entry else None

    def progress(self, child_id: str) -> Progress | None:
        """What an unfinished engine request has streamed so far, for resuming it elsewhere (None: finished or
        closed)."""
        entry = self._child_to_parent.get(child_id)
        if entry is None or entry[1].finished:
            return None
        parent, child = entry
        return Progress(child.request, parent.request_id, list(child.token_ids),
                        None if child.logprobs is None else list(child.logprobs),
                        None if parent.prompt_logprobs is None else parent.prompt_logprobs[1:])

    def child_ids(self, request_id: str) -> list[str]:
        parent = self._parents.get(request_id)
        return [c.request.request_id for c in parent.children] if parent else []

    def has_unfinished(self) -> bool:
        return bool(self._parents)

    def abort(self, request_id: str) -> RequestOutput | None:
        parent = self._parents.get(request_id)
        if parent is None:
            return None
        for child in parent.children:
            if not child.finished:
                child.finish_reason = "abort"
        self._drop(parent)
        return self._output(parent, set())

    def process(self, core_outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Returns the outputs to hand out and the child ids that a stop string has just finished."""
        touched: dict[str, tuple[_Parent, set[int]]] = {}
        stopped: list[str] = []
        for out in core_outputs:
            entry = self._child_to_parent.get(out.request_id)
            if entry is None:
                continue
            parent, child = entry
            if out.prompt_logprobs is not None and parent.prompt_logprobs is None:
                parent.prompt_logprobs = [None, *out.prompt_logprobs]
            if out.pooled is not None:
                parent.pooled = out.pooled
            if child.finished:
                continue
            self._advance(child, out)
            if out.finish_reason is None and child.finished:
                stopped.append(out.request_id)
            touched.setdefault(parent.request_id, (parent, set()))[1].add(child.index)
        results = []
        for parent, indices in touched.values():
            results.append(self._output(parent, indices))
            if parent.finished:
                self._drop(parent)
        return results, stopped

    def _advance(self, child: _Completion, out: EngineCoreOutput) -> None:
        params = child.request.sampling_params
        # One token at a time when several arrive together (speculative decoding): none past a stop string.
        for i, token in enumerate(out.new_token_ids):
            child.token_ids.append(token)
            if child.logprobs is not None and i < len(out.new_logprobs):
                entry = out.new_logprobs[i]
                child.logprobs.append(entry)
                child.cumulative_logprob = (child.cumulative_logprob or 0.0) + entry[token]
            last = i == len(out.new_token_ids) - 1
            # as vLLM: the token that stopped the request (EOS, a stop token id) is not part of the text, even
            # where special tokens are kept (tool-call markers)
            ended_by = last and out.finish_reason == "stop" and not params.include_stop_str_in_output and (
                token == out.stop_reason or (token in child.request.eos_token_ids and not params.ignore_eos))
            delta = "" if ended_by else child.detokenizer.add_tokens([token])
            if last and out.finish_reason is not None:
                delta += child.detokenizer.finish()
            previous_len = len(child.text)
            child.text += delta
            if params.stop and len(child.token_ids) >= params.min_tokens:
                self._check_stop_strings(child, previous_len)
                if child.finished:  # the tokens after it are dropped
                    return
        if out.finish_reason is not None and not child.finished:
            child.finish_reason, child.stop_reason = out.finish_reason, out.stop_reason

    @staticmethod
    def _check_stop_strings(child: _Completion, previous_len: int) -> None:
        params = child.request.sampling_params
        longest = max(len(s) for s in params.stop)
        search_from = max(0, previous_len - longest + 1)
        best: tuple[int, str] | None = None
        for stop in params.stop:
            at = child.text.find(stop, search_from)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        if best is not None:
            at, stop = best
            child.text = child.text[: at + len(stop) if params.include_stop_str_in_output else at]
            child.finish_reason, child.stop_reason = "stop", stop

    def _output(self, parent: _Parent, touched: set[int]) -> RequestOutput:
        completions = []
        for child in parent.children:
            params = child.request.sampling_params
            holdback = 0 if child.finished or not params.stop or params.include_stop_str_in_output else (
                max(len(s) for s in params.stop) - 1)
            end = max(child.emitted, len(child.text) - holdback)
            delta_text = child.text[child.emitted:end] if child.index in touched else ""
            delta_tokens = child.token_ids[child.tokens_emitted:] if child.index in touched else []
            if child.index in touched:
                child.emitted = end
                child.tokens_emitted = len(child.token_ids)
            completions.append(CompletionOutput(
                index=child.index,
                text=child.text[:child.emitted] if not child.finished else child.text,
                token_ids=list(child.token_ids),
                finish_reason=child.finish_reason,
                stop_reason=child.stop_reason,
                logprobs=None if child.logprobs is None else list(child.logprobs),
                cumulative_logprob=child.cumulative_logprob,
                delta_text=delta_text,
                delta_token_ids=delta_tokens,
            ))
        first = parent.children[0].request
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=completions,
            finished=parent.finished,
            num_cached_tokens=max(0, first.num_cached_tokens),
            prompt_logprobs=parent.prompt_logprobs,
            pooled=parent.pooled,
            metrics=[_metrics(c.request) for c in parent.children],
        )

    def _drop(self, parent: _Parent) -> None:
        self._parents.pop(parent.request_id, None)
        for child in parent.children:
            self._child_to_parent.pop(child.request.request_id, None)


def _metrics(request: Request) -> RequestMetrics:
    t = request.times
    return RequestMetrics(
        arrival_time=t.arrival, first_scheduled_time=t.first_scheduled, first_token_time=t.first_token,
        last_token_time=t.last_token, finished_time=t.finished, token_times=list(t.token_times),
        num_preemptions=request.num_preemptions, num_recomputed_tokens=request.num_recomputed_tokens,
        prefill_chunks=list(t.prefill_chunks), num_migrations=request.num_migrations,
    )
