"""OpenAI API request models (pydantic) and the sampling parameters they map to."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tokenmill.beam_search import BeamSearchParams
from tokenmill.sampling_params import MAX_LOGPROBS, SamplingParams
from tokenmill.structured_output.params import StructuredOutputsParams


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text (no constraint), any JSON object, or a JSON schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.json_schema is None):
            raise ValueError("a json_schema response format needs json_schema.schema")
        return self


class _SamplingFields(BaseModel):
    # Unknown fields are ignored, as OpenAI clients send extras and vLLM accepts them.
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = Field(1, ge=1, le=16)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    priority: int = 0
    cache_salt: str | None = None  # vLLM's: requests with different salts share no KV (server/cache_salt.py)
    stream: bool = False
    stream_options: StreamOptions | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[str, float] | None = None
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty strings")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        # JSON object keys are strings: each must spell a token id (OpenAI rejects anything else too); the
        # values' range is SamplingParams' check.
        for key in value or {}:
            if not key.strip().isdigit():
                raise ValueError(f"keys must be token ids (non-negative integers), got {key!r}")
        return value

    def constraint(self) -> StructuredOutputsParams | None:
        """The one output constraint the request asks for, from whichever field it used (ValueError for two)."""
        given: list[StructuredOutputsParams] = []
        if self.response_format is not None and self.response_format.type == "json_object":
            given.append(StructuredOutputsParams(json_object=True))
        elif self.response_format is not None and self.response_format.type == "json_schema":
            given.append(StructuredOutputsParams(json=self.response_format.json_schema.json_schema))  # type: ignore[union-attr]
        if self.structured_outputs is not None:
            try:
                given.append(StructuredOutputsParams(**self.structured_outputs))
            except TypeError as exc:  # an unknown key
                raise ValueError(f"structured_outputs: {exc}") from exc
        guided: dict[str, Any] = {"json": self.guided_json, "regex": self.guided_regex, "choice": self.guided_choice,
                                  "grammar": self.guided_grammar}
        given += [StructuredOutputsParams(**{kind: value}) for kind, value in guided.items() if value is not None]
        if len(given) > 1:
            raise ValueError("only one structured outputs constraint can be used (response_format, "
                             "structured_outputs, guided_json, guided_regex, guided_choice, guided_grammar, or a "
                             "forced tool call)")
        return given[0] if given else None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        constraint: StructuredOutputsParams | None = None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k in (None, -1) else int(self.top_k),  # type: ignore[arg-type]
            min_p=self.min_p or 0.0,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            logit_bias={int(k): float(v) for k, v in self.logit_bias.items()} if self.logit_bias else None,
            structured_outputs=constraint,
        )


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)  # 0 only with echo: score the prompt, generate nothing
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False  # the prompt in front of the completion (with its logprobs when logprobs is set)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # vLLM's: each choice's prompt_logprobs
    suffix: str | None = None
    # vLLM's beam search: the n best of beam_width beams (beam_width defaults to n)
    use_beam_search: bool = False
    # samples drawn, the n most likely returned; with beam search, the beam width (vLLM's first API)
    best_of: int | None = Field(None, ge=1, le=16)
    beam_width: int | None = Field(None, ge=1, le=MAX_LOGPROBS // 2)
    length_penalty: float = 1.0

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, value: Any) -> Any:
        if isinstance(value, str):
            if not value:
                raise ValueError("prompt must not be empty")
        elif not value:
            raise ValueError("prompt must not be an empty list")
        elif isinstance(value[0], list) and any(not p for p in value):
            raise ValueError("token prompts must not be empty")
        elif isinstance(value[0], str) and any(not p for p in value):
            raise ValueError("prompts must not be empty strings")
        return value

    @model_validator(mode="after")
    def _unsupported(self) -> CompletionRequest:
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens must be at least 1 (0 only with echo, which returns the prompt)")
        if self.use_beam_search:
            if self.stream:
                raise ValueError("streaming is not supported with beam search")
            if self.echo or self.logprobs is not None or self.prompt_logprobs is not None:
                raise ValueError("beam search returns no logprobs and no echo")
            width = self.beam_width or self.best_of or self.n
            if self.n > width:
                raise ValueError(f"n ({self.n}) cannot exceed the beam width ({width})")
        elif self.beam_width is not None:
            raise ValueError("beam_width needs use_beam_search")
        if self.best_of is not None:
            if self.best_of < self.n:
                raise ValueError(f"best_of ({self.best_of}) must be at least n ({self.n})")
            if self.stream and self.best_of > self.n:
                raise ValueError("best_of cannot be used with stream")
        return self

    def beam_search_params(self) -> BeamSearchParams:
        return BeamSearchParams(beam_width=self.beam_width or self.best_of or self.n, max_tokens=self.max_tokens or 16,
                                ignore_eos=self.ignore_eos, length_penalty=self.length_penalty)

    @property
    def scored_prompt_logprobs(self) -> int | None:
        """The engine's prompt_logprobs: asked for directly, or what echo with logprobs hands back."""
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs

    @property
    def engine_max_tokens(self) -> int | None:
        """max_tokens 0 still samples one token after the prompt (the engine's unit of work); it is dropped."""
        return 1 if self.max_tokens == 0 else self.max_tokens

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCallMessage(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCallMessage] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool result: the call it answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionDefinition(BaseModel):
    name: str = Field(..., min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        return self

    @model_validator(mode="after")
    def _tool_choice(self) -> ChatCompletionRequest:
        if self.tool_choice not in (None, "none") and not self.tools:
            raise ValueError("tool_choice needs tools")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tools and \
                self.tool_choice.function.name not in {t.function.name for t in self.tools}:
            raise ValueError(f"tool_choice names the function {self.tool_choice.function.name!r}, which is not in "
                             f"tools")
        return self

    @property
    def tool_mode(self) -> str:
        """none, auto, required or named (OpenAI's default: auto when tools are given)."""
        if not self.tools:
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    def tool_definitions(self) -> list[dict[str, Any]]:
        return [t.function.model_dump(exclude_none=True) for t in self.tools or []]

    def conversation(self) -> list[dict[str, Any]]:
        return [message_dict(m) for m in self.messages]


def message_dict(m: ChatMessage) -> dict[str, Any]:
    """A chat message as the chat template reads it."""
    message: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
    if m.tool_calls:
        message["tool_calls"] = [c.model_dump() for c in m.tool_calls]
    if m.tool_call_id is not None:
        message["tool_call_id"] = m.tool_call_id
    return message
