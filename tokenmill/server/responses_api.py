"""OpenAI's Responses API: POST /v1/responses (whole, or streamed with the typed events the SDK parses) and
GET /v1/responses/{id}, over the same chat template, tool machinery and engine as chat completions.

`store` (the default) keeps a response, and the conversation that led to it, in a bounded in-memory store (the
least recently used goes first) so that `previous_response_id` can continue it; an unknown or evicted id is a
404. Nothing survives a restart."""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from typing import Any, Literal

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

DEFAULT_STORE_SIZE = 1000  # responses kept for previous_response_id

# ------------------------------------------------------------------ the request


class InputText(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["input_text", "output_text", "text"]
    text: str


class MessageItem(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class FunctionCallItem(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function_call_output"]
    call_id: str
    output: str


class ReasoningItem(BaseModel):
    """An earlier turn's reasoning sent back by a client: not shown to the model again."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["reasoning"]


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    name: str = Field(..., min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(BaseModel):
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True, extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema(self) -> TextFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("a json_schema text format needs a schema")
        return self


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")

    format: TextFormat | None = None


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # reasoning, truncation, user, service_tier...

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None

    @model_validator(mode="after")
    def _tools(self) -> ResponsesRequest:
        if self.tool_choice not in (None, "none") and not self.tools:
            raise ValueError("tool_choice needs tools")
        if isinstance(self.tool_choice, NamedFunction) and \
                self.tool_choice.name not in {t.name for t in self.tools or []}:
            raise ValueError(f"tool_choice names the function {self.tool_choice.name!r}, which is not in tools")
        if isinstance(self.input, list) and not self.input:
            raise ValueError("input must not be empty")
        return self

    @property
    def tool_mode(self) -> str:
        if not self.tools:
            return "none"
        if isinstance(self.tool_choice, NamedFunction):
            return "named"
        return self.tool_choice or "auto"

    def tool_definitions(self) -> list[dict[str, Any]]:
        if self.tool_mode == "none":
            return []
        return [t.model_dump(exclude_none=True, exclude={"type", "strict"}) for t in self.tools or []]

    def constraint(self) -> StructuredOutputsParams | None:
        output_format = self.text.format if self.text is not None else None
        if output_format is None or output_format.type == "text":
            return None
        if output_format.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        return StructuredOutputsParams(json=output_format.json_schema)

    def conversation(self) -> list[dict[str, Any]]:
        """This turn's input in the chat API's shape (function calls as an assistant's tool_calls)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        out: list[dict[str, Any]] = []
        for item in self.input:
            if isinstance(item, MessageItem):
                out.append({"role": "system" if item.role == "developer" else item.role, "content": item.text()})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") is not None:
                    out[-1]["tool_calls"].append(call)
                else:
                    out.append({"role": "assistant", "content": "", "tool_calls": [call]})
            elif isinstance(item, FunctionCallOutputItem):
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        return out

    def sampling_params(self, constraint: StructuredOutputsParams | None) -> SamplingParams:
        return SamplingParams(temperature=1.0 if self.temperature is None else self.temperature,
                              top_p=1.0 if self.top_p is None else self.top_p, max_tokens=self.max_output_tokens,
                              structured_outputs=constraint)


# ------------------------------------------------------------------ the store


class ResponseStore:
    """Stored responses and their conversations, the least recently used evicted past `capacity`."""

    def __init__(self, capacity: int = DEFAULT_STORE_SIZE) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = OrderedDict()

    def put(self, body: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        if self.capacity <= 0:
            return
        self._items[body["id"]] = (body, conversation)
        self._items.move_to_end(body["id"])
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        item = self._items.get(response_id)
        if item is None:
            raise APIError(404, f"no stored response with id {response_id!r} (unknown, not stored, or evicted)",
                           "not_found_error", "previous_response_id")
        self._items.move_to_end(response_id)
        return item

    def __len__(self) -> int:
        return len(self._items)


# ------------------------------------------------------------------ the response


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesBuilder(PartEvents):
    """A Response object, or its stream of typed events (each with its sequence number)."""

    def __init__(self, body: ResponsesRequest, model: str, conversation: list[dict[str, Any]], prompt_tokens: int,
                 store: ResponseStore | None, tools: ToolParser | None = None,
                 reasoning: ReasoningParser | None = None) -> None:
        self.request = body
        self.response_id = _new_id("resp")
        self.model = model
        self.conversation = conversation
        self.prompt_tokens = prompt_tokens
        self.store = store
        self.tools = tools  # the output's call parser (None: tool mode none)
        self.created_at = int(time.time())
        self.text = ""
        self.output_tokens = 0
        self.cached_tokens = 0
        self.finish_reason: str | None = None
        self.sequence = 0
        self.reasoning = reasoning  # the <think> block becomes a reasoning item in front of the answer
        self.parts = OutputSplitter(reasoning, tools)
        self.items: list[dict[str, Any]] = []  # streamed output items, in order
        self.open_item: dict[str, Any] | None = None

    def update(self, prompt_index: int, output: RequestOutput) -> RequestOutput:
        completion = output.outputs[0]
        self.text = completion.text
        self.output_tokens = len(completion.token_ids)
        self.cached_tokens = output.num_cached_tokens
        self.finish_reason = completion.finish_reason
        return output

    def _body(self, status: str, output: list[dict[str, Any]]) -> dict[str, Any]:
        body = self.request
        incomplete = status == "incomplete"
        tool_choice = body.tool_choice.model_dump() if isinstance(body.tool_choice, NamedFunction) else (
            body.tool_choice or "auto")
        return {
            "id": self.response_id, "object": "response", "created_at": self.created_at, "status": status,
            "model": self.model, "output": output, "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens, "temperature": body.temperature, "top_p": body.top_p,
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or []], "tool_choice": tool_choice,
            "parallel_tool_calls": body.parallel_tool_calls,
            "text": (body.text.model_dump(by_alias=True, exclude_none=True) if body.text
                     else {"format": {"type": "text"}}),
            "previous_response_id": body.previous_response_id, "store": body.store, "metadata": body.metadata or {},
            "error": None, "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "usage": None if status == "in_progress" else {
                "input_tokens": self.prompt_tokens, "output_tokens": self.output_tokens,
                "total_tokens": self.prompt_tokens + self.output_tokens,
                "input_tokens_details": {"cached_tokens": self.cached_tokens, "cache_write_tokens": 0},
                "output_tokens_details": {"reasoning_tokens": 0}},
        }

    @staticmethod
    def _message(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
        return {"type": "message", "id": item_id, "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}

    @staticmethod
    def _reasoning(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
        return {"type": "reasoning", "id": item_id, "status": status, "summary": [],
                "content": [{"type": "reasoning_text", "text": text}]}

    @staticmethod
    def _call(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
        return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
                "status": status}

    def _finish(self, output: list[dict[str, Any]]) -> dict[str, Any]:
        body = self._body("incomplete" if self.finish_reason == "length" else "completed", output)
        if self.store is not None and self.request.store:
            calls = [{"id": item["call_id"], "type": "function",
                      "function": {"name": item["name"], "arguments": item["arguments"]}}
                     for item in output if item["type"] == "function_call"]
            text = "".join(item["content"][0]["text"] for item in output if item["type"] == "message")
            answer: dict[str, Any] = {"role": "assistant", "content": text}
            if calls:
                answer["tool_calls"] = calls
            self.store.put(body, [*self.conversation, answer])
        return body

    def final(self) -> dict[str, Any]:
        thought, text, calls = split_output(self.text, self.reasoning, self.tools)
        output = [] if thought is None else [self._reasoning(_new_id("rs"), thought)]
        if text or not (calls or output):
            output.append(self._message(_new_id("msg"), text or ""))
        output += [self._call(_new_id("fc"), _new_id("call"), c.name, c.arguments) for c in calls]
        return self._finish(output)

    # ------------------------------------------------------------------ the stream

    def _event(self, kind: str, **payload: Any) -> str:
        event = {"type": kind, "sequence_number": self.sequence, **payload}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(event)}\n\n"

    def opening_events(self) -> list[str]:
        response = self._body("in_progress", [])
        return [self._event("response.created", response=response),
                self._event("response.in_progress", response=response)]

    def _open(self, item: dict[str, Any]) -> list[str]:
        events = self._close()
        self.open_item = item
        self.items.append(item)
        index = len(self.items) - 1
        added = {**item, "status": "in_progress"}
        if item["type"] in ("message", "reasoning"):
            added["content"] = []
        events.append(self._event("response.output_item.added", output_index=index, item=added))
        if item["type"] == "message":
            events.append(self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                      content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
        return events

    def _close(self) -> list[str]:
        item, self.open_item = self.open_item, None
        if item is None:
            return []
        index = len(self.items) - 1
        if item["type"] == "reasoning":
            return [self._event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                content_index=0, text=item["content"][0]["text"]),
                    self._event("response.output_item.done", output_index=index, item=item)]
        if item["type"] == "message":
            part = item["content"][0]
            return [self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                content_index=0, text=part["text"], logprobs=[]),
                    self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                content_index=0, part=part),
                    self._event("response.output_item.done", output_index=index, item=item)]
        return [self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                            arguments=item["arguments"], name=item["name"]),
                self._event("response.output_item.done", output_index=index, item=item)]

    def _stream_text(self, kind: str, text: str) -> list[str]:
        """A piece of the answer (kind "message") or of the reasoning (kind "reasoning"), in the item of that
        kind (opened if another one is open)."""
        if not text:
            return []
        events = []
        if self.open_item is None or self.open_item["type"] != kind:
            item = self._message(_new_id("msg"), "") if kind == "message" else self._reasoning(_new_id("rs"), "")
            events = self._open(item)
        assert self.open_item is not None
        self.open_item["content"][0]["text"] += text
        where = {"item_id": self.open_item["id"], "output_index": len(self.items) - 1, "content_index": 0}
        if kind == "message":
            events.append(self._event("response.output_text.delta", **where, delta=text, logprobs=[]))
        else:
            events.append(self._event("response.reasoning_text.delta", **where, delta=text))
        return events

    def part_events(self, part: Part) -> list[str]:
        if part.kind == "reasoning":
            return self._stream_text("reasoning", part.text)
        if part.kind == "text":
            return self._stream_text("message", part.text)
        if part.kind == "call":
            return self._open(self._call(_new_id("fc"), _new_id("call"), part.text, ""))
        if self.open_item is None:
            return []
        self.open_item["arguments"] += part.text
        return [self._event("response.function_call_arguments.delta", item_id=self.open_item["id"],
                            output_index=len(self.items) - 1, delta=part.text)]

    def closing_events(self) -> list[str]:
        events = self._close()
        if not self.items:
            events += self._open(self._message(_new_id("msg"), "")) + self._close()
        return events + [self._event("response.completed", response=self._finish(self.items))]

    def error_events(self, error: APIError) -> list[str]:
        return [self._event("error", code=str(error.status), message=error.message, param=error.param)]


# ------------------------------------------------------------------ the routes


def add_responses_routes(app: FastAPI, serving: Serving, store: ResponseStore) -> None:
    @app.post("/v1/responses", dependencies=[Depends(serving.check_api_key)])
    async def responses(body: ResponsesRequest, http_request: Request) -> Response:
        lora = serving.check_model(body.model)
        tool_mode = body.tool_mode
        serving.check_tool_mode(tool_mode)
        tools = body.tool_definitions()
        named = body.tool_choice.name if isinstance(body.tool_choice, NamedFunction) else None
        params = serving.with_tools(params_or_400(lambda: body.sampling_params(serving.tool_constraint(
            tool_mode, tools, named, body.parallel_tool_calls, body.constraint()))), tool_mode)
        history = store.get(body.previous_response_id)[1] if body.previous_response_id else []
        conversation = [*history, *body.conversation()]
        # instructions belong to this turn: a continued response does not carry earlier ones (OpenAI's rule)
        instructions = [{"role": "system", "content": body.instructions}] if body.instructions else []
        prompt_ids = serving.encode_chat([*instructions, *conversation], tools)
        builder = ResponsesBuilder(body, serving.served_name(lora), conversation, len(prompt_ids), store,
                                   serving.parser_for(tool_mode, tools), serving.reasoning)
        return await serving.serve(builder, [{"prompt_token_ids": prompt_ids}], params, 0, body.stream, http_request,
                                   lora)

    @app.get("/v1/responses/{response_id}", dependencies=[Depends(serving.check_api_key)])
    async def stored_response(response_id: str) -> dict[str, Any]:
        return store.get(response_id)[0]
