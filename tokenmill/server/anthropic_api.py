"""Anthropic's Messages API: POST /v1/messages (whole, or streamed with Anthropic's events) and
POST /v1/messages/count_tokens, over the same chat template, tool machinery and engine as chat completions."""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Literal

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, model_validator

from tokenmill.outputs import RequestOutput
from tokenmill.reasoning import ReasoningParser
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.errors import APIError
from tokenmill.server.output_parts import OutputSplitter, Part, PartEvents, split_output
from tokenmill.server.serving import Serving, params_or_400
from tokenmill.structured_output.params import StructuredOutputsParams
from tokenmill.tool_parsers import ToolParser

ANTHROPIC_PATH = "/v1/messages"

# our error types -> Anthropic's
_ERROR_TYPES = {"rate_limit_exceeded": "rate_limit_error", "internal_server_error": "api_error",
                "service_unavailable": "overloaded_error", "timeout_error": "api_error"}


def anthropic_error_body(message: str, err_type: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(err_type, err_type), "message": message}}


# ------------------------------------------------------------------ the request


class TextBlock(BaseModel):
    model_config = ConfigDict(extra="ignore")  # cache_control, citations

    type: Literal["text"]
    text: str


class ToolUseBlock(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool = False

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(block.text for block in self.content)


class ThinkingBlock(BaseModel):
    """An earlier turn's reasoning, sent back by clients; not shown to the model again (as Anthropic drops it)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["thinking", "redacted_thinking"]


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock, Field(discriminator="type")]


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["user", "assistant"]
    content: str | list[Block]


class AnthropicTool(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(..., min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    input_schema: dict[str, Any]


class AnthropicToolChoice(BaseModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class _Conversation(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    messages: list[AnthropicMessage] = Field(..., min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None

    @model_validator(mode="after")
    def _tool_choice(self) -> _Conversation:
        choice = self.tool_choice
        if choice is not None and choice.type in ("any", "tool") and not self.tools:
            raise ValueError(f"tool_choice {choice.type!r} needs tools")
        if choice is not None and choice.type == "tool":
            if not choice.name:
                raise ValueError('tool_choice {"type": "tool"} needs a name')
            if choice.name not in {t.name for t in self.tools or []}:
                raise ValueError(f"tool_choice names the tool {choice.name!r}, which is not in tools")
        return self

    @property
    def tool_mode(self) -> str:
        """The chat API's tool modes: auto (Anthropic's default with tools), required (any), named, none."""
        if not self.tools:
            return "none"
        kind = self.tool_choice.type if self.tool_choice is not None else "auto"
        return {"any": "required", "tool": "named"}.get(kind, kind)

    def tool_definitions(self) -> list[dict[str, Any]]:
        if self.tool_mode == "none":
            return []
        return [{"name": t.name, **({"description": t.description} if t.description else {}),
                 "parameters": t.input_schema} for t in self.tools or []]

    def conversation(self) -> list[dict[str, Any]]:
        """The messages in the chat API's shape: tool_use blocks become an assistant's tool_calls, tool_result
        blocks `tool` messages."""
        out: list[dict[str, Any]] = []
        system = self.system if isinstance(self.system, str) else "".join(b.text for b in self.system or [])
        if system:
            out.append({"role": "system", "content": system})
        for message in self.messages:
            if isinstance(message.content, str):
                out.append({"role": message.role, "content": message.content})
                continue
            texts: list[str] = []
            calls: list[dict[str, Any]] = []
            for block in message.content:
                if isinstance(block, TextBlock):
                    texts.append(block.text)
                elif isinstance(block, ToolUseBlock):
                    if message.role != "assistant":
                        raise ValueError("tool_use blocks belong to assistant messages")
                    calls.append({"id": block.id, "type": "function", "function": {
                        "name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
                elif isinstance(block, ToolResultBlock):
                    if message.role != "user":
                        raise ValueError("tool_result blocks belong to user messages")
                    out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                                "content": ("Error: " if block.is_error else "") + block.text()})
            if texts or calls:
                entry: dict[str, Any] = {"role": message.role, "content": "".join(texts)}
                if calls:
                    entry["tool_calls"] = calls
                out.append(entry)
        return out


class OutputFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(..., alias="schema")


class OutputConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")  # effort: no meaning for a local model

    format: OutputFormat | None = None


class MessagesRequest(_Conversation):
    max_tokens: int = Field(..., ge=1)
    stop_sequences: list[Annotated[str, Field(min_length=1)]] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False
    metadata: dict[str, Any] | None = None
    output_config: OutputConfig | None = None  # format: a JSON schema the answer follows (structured outputs)

    def constraint(self) -> StructuredOutputsParams | None:
        output_format = self.output_config.format if self.output_config is not None else None
        return None if output_format is None else StructuredOutputsParams(json=output_format.json_schema)

    def sampling_params(self, constraint: Any) -> SamplingParams:
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,  # Anthropic's default
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0,
            max_tokens=self.max_tokens, stop=list(self.stop_sequences or []), structured_outputs=constraint)


# ------------------------------------------------------------------ the response


# a streamed block as content_block_start announces it; its deltas are {"type": "<kind>_delta", "<kind>": ...}
_EMPTY_BLOCKS: dict[str, dict[str, str]] = {"text": {"type": "text", "text": ""},
                                            "thinking": {"type": "thinking", "thinking": "", "signature": ""}}


def _event(kind: str, payload: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload})}\n\n"


def _tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


class MessagesBuilder(PartEvents):
    """A Message body, or its stream: message_start, then each content block's start / deltas / stop, then
    message_delta (stop_reason, usage) and message_stop."""

    def __init__(self, model: str, prompt_tokens: int, tools: ToolParser | None, stop_sequences: list[str],
                 reasoning: ReasoningParser | None = None) -> None:
        self.response_id = f"msg_{uuid.uuid4().hex}"
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.tools = tools  # the output's call parser (None: tool mode none)
        self.stop_sequences = stop_sequences
        self.text = ""
        self.output_tokens = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.reasoning = reasoning  # the <think> block becomes a thinking block in front of the answer
        self.parts = OutputSplitter(reasoning, tools)
        self.blocks = 0  # content blocks started
        self.open_block: str | None = None  # "text" or "tool_use"
        self.called = False

    def update(self, prompt_index: int, output: RequestOutput) -> RequestOutput:
        completion = output.outputs[0]
        self.text = completion.text
        self.output_tokens = len(completion.token_ids)
        self.finish_reason, self.stop_reason = completion.finish_reason, completion.stop_reason
        return output

    def _stop(self) -> tuple[str, str | None]:
        if self.called:
            return "tool_use", None
        if self.finish_reason == "length":
            return "max_tokens", None
        if isinstance(self.stop_reason, str) and self.stop_reason in self.stop_sequences:
            return "stop_sequence", self.stop_reason
        return "end_turn", None

    def _usage(self) -> dict[str, int]:
        return {"input_tokens": self.prompt_tokens, "output_tokens": self.output_tokens}

    def final(self) -> dict[str, Any]:
        thinking, text, calls = split_output(self.text, self.reasoning, self.tools)
        self.called = bool(calls)
        content = [{"type": "tool_use", "id": _tool_use_id(), "name": c.name, "input": json.loads(c.arguments)}
                   for c in calls]
        if text or not content:
            content.insert(0, {"type": "text", "text": text or ""})
        if thinking is not None:
            content.insert(0, {"type": "thinking", "thinking": thinking, "signature": ""})
        stop_reason, stop_sequence = self._stop()
        return {"id": self.response_id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                "usage": self._usage()}

    # ------------------------------------------------------------------ the stream

    def opening_events(self) -> list[str]:
        message: dict[str, Any] = {
            "id": self.response_id, "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0}}
        return [_event("message_start", {"message": message})]

    def _start(self, kind: str, block: dict[str, Any]) -> list[str]:
        events = self._close()
        self.open_block = kind
        events.append(_event("content_block_start", {"index": self.blocks, "content_block": block}))
        self.blocks += 1
        return events

    def _close(self) -> list[str]:
        if self.open_block is None:
            return []
        self.open_block = None
        return [_event("content_block_stop", {"index": self.blocks - 1})]

    def _stream_text(self, kind: str, text: str) -> list[str]:
        """A piece of the answer (kind "text") or of the reasoning (kind "thinking"), in the block of that kind
        (started if another one is open)."""
        if not text:
            return []
        events = [] if self.open_block == kind else self._start(kind, dict(_EMPTY_BLOCKS[kind]))
        events.append(_event("content_block_delta", {"index": self.blocks - 1,
                                                     "delta": {"type": f"{kind}_delta", kind: text}}))
        return events

    def part_events(self, part: Part) -> list[str]:
        if part.kind in ("reasoning", "text"):
            return self._stream_text("thinking" if part.kind == "reasoning" else "text", part.text)
        if part.kind == "call":
            self.called = True
            return self._start("tool_use", {"type": "tool_use", "id": _tool_use_id(), "name": part.text, "input": {}})
        return [_event("content_block_delta", {"index": self.blocks - 1,
                                               "delta": {"type": "input_json_delta", "partial_json": part.text}})]

    def closing_events(self) -> list[str]:
        events = self._close() if self.blocks else self._start("text", dict(_EMPTY_BLOCKS["text"])) + self._close()
        stop_reason, stop_sequence = self._stop()
        events.append(_event("message_delta", {"delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                               "usage": {"output_tokens": self.output_tokens}}))
        events.append(_event("message_stop", {}))
        return events

    def error_events(self, error: APIError) -> list[str]:
        body = anthropic_error_body(error.message, error.err_type)
        return [f"event: error\ndata: {json.dumps(body)}\n\n"]


# ------------------------------------------------------------------ the routes


def add_messages_routes(app: FastAPI, serving: Serving) -> None:
    def prompt_of(body: _Conversation) -> list[int]:
        try:
            conversation = body.conversation()
        except ValueError as exc:
            raise APIError(400, str(exc), param="messages") from exc
        return serving.encode_chat(conversation, body.tool_definitions())

    @app.post(ANTHROPIC_PATH, dependencies=[Depends(serving.check_api_key)])
    async def messages(body: MessagesRequest, http_request: Request) -> Response:
        lora = serving.check_model(body.model)
        tool_mode = body.tool_mode
        serving.check_tool_mode(tool_mode)
        tools = body.tool_definitions()
        choice = body.tool_choice
        named = choice.name if choice is not None and choice.type == "tool" else None
        parallel = not (choice is not None and choice.disable_parallel_tool_use)
        params = serving.with_tools(params_or_400(lambda: body.sampling_params(serving.tool_constraint(
            tool_mode, tools, named, parallel, body.constraint()))), tool_mode)
        prompt_ids = prompt_of(body)
        builder = MessagesBuilder(serving.served_name(lora), len(prompt_ids), serving.parser_for(tool_mode, tools),
                                  list(body.stop_sequences or []), serving.reasoning)
        return await serving.serve(builder, [{"prompt_token_ids": prompt_ids}], params, 0, body.stream, http_request,
                                   lora)

    @app.post(ANTHROPIC_PATH + "/count_tokens", dependencies=[Depends(serving.check_api_key)])
    async def count_tokens(body: _Conversation) -> dict[str, int]:
        serving.check_model(body.model)
        return {"input_tokens": len(prompt_of(body))}
