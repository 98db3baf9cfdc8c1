"""Builds OpenAI response bodies and stream chunks from RequestOutputs."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from tokenmill.model.tokenizer import Tokenizer
from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.reasoning import ReasoningParser, ReasoningStreamer
from tokenmill.server.errors import APIError
from tokenmill.server.middleware import error_body
from tokenmill.tool_parsers import ToolCallStreamer, ToolParser


@dataclass
class ChoiceState:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs_sent: int = 0
    tool_calls: ToolCallStreamer | None = None  # streaming with tools: splits the text into content and calls
    echoed: bool = False  # echo, streaming: the prompt went out in front of the first delta
    reasoning: ReasoningStreamer | None = None  # a reasoning parser: splits the text into reasoning and answer
    cumulative_logprob: float | None = None


@dataclass
class EchoedPrompt:
    """A completion prompt handed back in front of its completions (`echo`)."""

    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float] | None] | None  # from SamplingParams.prompt_logprobs, the first None


class StreamBuilder(Protocol):
    """What the server needs of an API's response shapes: the whole body, or its stream as SSE events."""

    response_id: str

    def update(self, prompt_index: int, output: RequestOutput) -> object: ...

    def final(self) -> dict[str, Any]: ...

    def opening_events(self) -> list[str]: ...

    def delta_events(self, prompt_index: int, output: RequestOutput) -> list[str]: ...

    def closing_events(self) -> list[str]: ...

    def error_events(self, error: APIError) -> list[str]: ...


def sse_data(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


class ResponseBuilder:
    def __init__(self, kind: Literal["completion", "chat"], model: str, tokenizer: Tokenizer, num_prompts: int,
                 n: int, logprobs: int | None, request_id: str | None = None, tool_mode: str = "none",
                 tool_parser: ToolParser | None = None,
                 echo: bool = False, drop_generated: bool = False, prompt_logprobs: int | None = None,
                 reasoning: ReasoningParser | None = None, keep_best: int | None = None) -> None:
        self.kind = kind
        # best_of: each prompt's n samples are cut to the keep_best most likely (cumulative logprob, vLLM's rule)
        self.keep_best = keep_best
        self.reasoning = reasoning  # chat: the <think> block goes to reasoning_content
        # completions: `echo` puts each prompt in front of its completions; `drop_generated` (max_tokens 0)
        # keeps the prompt only (the engine still sampled one token, which nobody asked for)
        self.echo = echo
        self.drop_generated = drop_generated
        self.prompt_logprobs = prompt_logprobs  # vLLM's prompt_logprobs field in each choice
        # auto / required / named: the output may hold tool calls (none: it is all content)
        self.tool_mode = tool_mode
        self.tool_parser = tool_parser  # reads the calls in the output (None: tool mode none)
        self.model = model
        self.tokenizer = tokenizer
        self.n = n
        self.top_logprobs = logprobs
        # vLLM's rule: the id is the client's X-Request-Id when it sends one
        self.response_id = ("cmpl-" if kind == "completion" else "chatcmpl-") + (request_id or uuid.uuid4().hex)
        self.created = int(time.time())
        self.choices = [ChoiceState(tool_calls=ToolCallStreamer(tool_parser) if tool_parser is not None else None,
                                    reasoning=ReasoningStreamer(reasoning) if reasoning is not None else None)
                        for _ in range(num_prompts * n)]
        self.prompt_tokens = [0] * num_prompts
        self.cached_tokens = [0] * num_prompts
        self.include_usage = False  # stream_options.include_usage
        self.prompts: list[EchoedPrompt | None] = [None] * num_prompts

    # ------------------------------------------------------------------ state

    def update(self, prompt_index: int, output: RequestOutput) -> list[tuple[int, CompletionOutput]]:
        self.prompt_tokens[prompt_index] = len(output.prompt_token_ids)
        self.cached_tokens[prompt_index] = output.num_cached_tokens
        if self.echo or self.prompt_logprobs is not None:
            self._record_prompt(prompt_index, output)
        changed = []
        for completion in output.outputs:
            if self.drop_generated:
                completion.text, completion.token_ids, completion.logprobs = "", [], None
                completion.delta_text, completion.delta_token_ids = "", []
            index = prompt_index * self.n + completion.index
            state = self.choices[index]
            state.text = completion.text
            state.token_ids = completion.token_ids
            state.logprobs = completion.logprobs or []
            state.finish_reason = completion.finish_reason
            state.stop_reason = completion.stop_reason
            state.cumulative_logprob = completion.cumulative_logprob
            if completion.delta_text or completion.delta_token_ids or completion.finish_reason:
                changed.append((index, completion))
        return changed

    def _record_prompt(self, prompt_index: int, output: RequestOutput) -> None:
        """The prompt echo and prompt_logprobs hand back: its text once (decoded for a token prompt), its
        logprobs when they arrive (with the first token)."""
        prompt = self.prompts[prompt_index]
        if prompt is None:
            text = output.prompt
            if text is None:
                text = self.tokenizer.decode(output.prompt_token_ids, skip_special_tokens=False)
            self.prompts[prompt_index] = EchoedPrompt(text, list(output.prompt_token_ids), output.prompt_logprobs)
        elif prompt.logprobs is None:
            prompt.logprobs = output.prompt_logprobs

    def usage(self) -> dict[str, Any]:
        completion_tokens = sum(len(c.token_ids) for c in self.choices)
        prompt_tokens = sum(self.prompt_tokens)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": sum(self.cached_tokens)}}

    # ------------------------------------------------------------------ logprobs

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _logprobs(self, state: ChoiceState, start: int, end: int, text_offset: int) -> dict[str, Any] | None:
        if self.top_logprobs is None:
            return None
        entries = list(zip(state.token_ids[start:end], state.logprobs[start:end]))
        top_n = self.top_logprobs
        if self.kind == "chat":
            content = []
            for token_id, entry in entries:
                token = self._token(token_id)
                top = sorted(entry.items(), key=lambda kv: -kv[1])[:top_n]
                content.append({
                    "token": token, "logprob": entry[token_id], "bytes": list(token.encode("utf-8")),
                    "top_logprobs": [{"token": self._token(t), "logprob": lp,
                                      "bytes": list(self._token(t).encode("utf-8"))} for t, lp in top],
                })
            return {"content": content}
        return self._legacy_logprobs(entries, top_n, text_offset)

    def _legacy_logprobs(self, entries: Sequence[tuple[int, dict[int, float] | None]], top_n: int,
                         text_offset: int) -> dict[str, Any]:
        """OpenAI's completions shape; a token without an entry (a prompt's first) has null logprobs."""
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        offset = text_offset
        for token_id, entry in entries:
            token = self._token(token_id)
            tokens.append(token)
            token_logprobs.append(None if entry is None else entry[token_id])
            tops.append(None if entry is None else
                        {self._token(t): lp for t, lp in sorted(entry.items(), key=lambda kv: -kv[1])[:top_n]})
            offsets.append(offset)
            offset += len(token)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}

    def _echo_logprobs(self, prompt: EchoedPrompt, completion: dict[str, Any] | None) -> dict[str, Any] | None:
        """The prompt's logprobs in front of a completion's (echo with logprobs)."""
        if self.top_logprobs is None:
            return None
        entries = prompt.logprobs or [None] * len(prompt.token_ids)
        echoed = self._legacy_logprobs(list(zip(prompt.token_ids, entries)), self.top_logprobs, 0)
        if completion is not None:
            for key in echoed:
                echoed[key].extend(completion[key])
        return echoed

    def _vllm_prompt_logprobs(self, prompt: EchoedPrompt | None) -> list[dict[str, Any] | None] | None:
        """vLLM's `prompt_logprobs` of a choice: per prompt token {token id: {logprob, rank, decoded_token}}
        (rank given for the top-N, which are ranked)."""
        if self.prompt_logprobs is None or prompt is None or prompt.logprobs is None:
            return None
        result: list[dict[str, Any] | None] = []
        for entry in prompt.logprobs:
            if entry is None:
                result.append(None)
                continue
            ranked = sorted(entry.items(), key=lambda kv: -kv[1])
            result.append({str(t): {"logprob": lp, "decoded_token": self._token(t),
                                    **({"rank": rank} if rank <= self.prompt_logprobs else {})}
                           for rank, (t, lp) in enumerate(ranked, 1)})
        return result

    # ------------------------------------------------------------------ bodies

    def final(self) -> dict[str, Any]:
        choices = []
        for index, state in enumerate(self.choices):
            logprobs = self._logprobs(state, 0, len(state.token_ids), 0)
            if self.kind == "chat":
                answer = state.text
                message: dict[str, Any] = {"role": "assistant", "content": answer}
                if self.reasoning is not None:  # tool calls and structured outputs are in the answer after it
                    message["reasoning_content"], answer = self.reasoning.split(state.text)
                    message["content"] = answer
                finish_reason = state.finish_reason
                if self.tool_parser is not None:
                    content, calls = self.tool_parser.parse(answer)
                    if calls:
                        message.update(content=content, tool_calls=[c.to_openai() for c in calls])
                        finish_reason = self._finish_reason(finish_reason, True)
                choices.append({"index": index, "message": message, "logprobs": logprobs,
                                "finish_reason": finish_reason, "stop_reason": state.stop_reason})
            else:
                prompt = self.prompts[index // self.n]
                text = state.text
                if self.echo and prompt is not None:
                    text = prompt.text + text
                    logprobs = self._echo_logprobs(prompt, self._logprobs(state, 0, len(state.token_ids),
                                                                          len(prompt.text)))
                choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": state.finish_reason,
                          "stop_reason": state.stop_reason}
                if self.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = self._vllm_prompt_logprobs(prompt)
                choices.append(choice)
        if self.keep_best is not None:
            choices = self._best(choices)
        return {"id": self.response_id, "object": "chat.completion" if self.kind == "chat" else "text_completion",
                "created": self.created, "model": self.model, "choices": choices, "usage": self.usage()}

    def _best(self, choices: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Each prompt's keep_best most likely samples, reindexed (best_of)."""
        assert self.keep_best is not None
        kept: list[dict[str, Any]] = []
        for start in range(0, len(choices), self.n):
            group = range(start, start + self.n)
            ranked = sorted(group, key=lambda i: -(self.choices[i].cumulative_logprob or 0.0))
            kept += [choices[i] for i in ranked[:self.keep_best]]
        return [{**choice, "index": index} for index, choice in enumerate(kept)]

    def _chunk(self, choices: list[dict[str, Any]], include_usage: bool) -> dict[str, Any]:
        chunk: dict[str, Any] = {
            "id": self.response_id,
            "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
            "created": self.created, "model": self.model, "choices": choices,
        }
        if include_usage:
            chunk["usage"] = None
        return chunk

    def opening_chunks(self, include_usage: bool = False) -> list[dict[str, Any]]:
        if self.kind != "chat":
            return []
        return [self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}], include_usage) for i in range(len(self.choices))]

    def delta_chunks(self, prompt_index: int, output: RequestOutput, include_usage: bool) -> list[dict[str, Any]]:
        chunks = []
        for index, completion in self.update(prompt_index, output):
            state = self.choices[index]
            end = len(state.token_ids)
            prompt = self.prompts[index // self.n]
            echoed = len(prompt.text) if self.echo and prompt is not None else 0  # text in front of the completion
            logprobs = self._logprobs(state, state.logprobs_sent, end,
                                      echoed + len(state.text) - len(completion.delta_text))
            state.logprobs_sent = end
            if self.kind == "chat":
                finish_reason = completion.finish_reason
                answer, thought = completion.delta_text, ""
                if state.reasoning is not None:
                    thought, answer = state.reasoning.feed(answer, final=finish_reason is not None)
                if state.tool_calls is None:
                    delta: dict[str, Any] = {"content": answer} if answer else {}
                else:
                    content, calls = state.tool_calls.feed(answer, final=finish_reason is not None)
                    delta = {"content": content} if content else {}
                    if calls:
                        delta["tool_calls"] = calls
                    finish_reason = self._finish_reason(finish_reason, state.tool_calls.called)
                if thought:
                    delta = {"reasoning_content": thought, **delta}
                choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            else:
                text = completion.delta_text
                first = prompt is not None and not state.echoed
                if first and self.echo:  # the prompt goes out once, in front of the first delta
                    assert prompt is not None
                    text = prompt.text + text
                    logprobs = self._echo_logprobs(prompt, logprobs)
                choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": completion.finish_reason}
                if first and self.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = self._vllm_prompt_logprobs(prompt)
                state.echoed = state.echoed or first
            if completion.finish_reason:
                choice["stop_reason"] = completion.stop_reason
            chunks.append(self._chunk([choice], include_usage))
        return chunks

    def _finish_reason(self, reason: str | None, called: bool) -> str | None:
        """OpenAI's: `tool_calls` when the model chose to call (auto, required); a named call ends with `stop`."""
        if reason == "stop" and called and self.tool_mode in ("auto", "required"):
            return "tool_calls"
        return reason

    def usage_chunk(self) -> dict[str, Any]:
        return {"id": self.response_id,
                "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
                "created": self.created, "model": self.model, "choices": [], "usage": self.usage()}

    # ------------------------------------------------------------------ SSE: data lines, then [DONE]

    def opening_events(self) -> list[str]:
        return [sse_data(c) for c in self.opening_chunks(self.include_usage)]

    def delta_events(self, prompt_index: int, output: RequestOutput) -> list[str]:
        return [sse_data(c) for c in self.delta_chunks(prompt_index, output, self.include_usage)]

    def closing_events(self) -> list[str]:
        return ([sse_data(self.usage_chunk())] if self.include_usage else []) + ["data: [DONE]\n\n"]

    def error_events(self, error: APIError) -> list[str]:
        return [sse_data(error_body(error.status, error.message, error.err_type, error.param)), "data: [DONE]\n\n"]
