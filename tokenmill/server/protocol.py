"""OpenAI API request models (pydantic) and the sampling parameters they map to."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tokenmill.sampling_params import MAX_LOGPROBS, SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False


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
    stream: bool = False
    stream_options: StreamOptions | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[str, float] | None = None

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

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
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
            skip_special_tokens=self.skip_special_tokens,
            logit_bias={int(k): float(v) for k, v in self.logit_bias.items()} if self.logit_bias else None,
        )


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None

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
        if self.echo:
            raise ValueError("echo is not supported")
        return self

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


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        return self

    def conversation(self) -> list[dict[str, str]]:
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]
