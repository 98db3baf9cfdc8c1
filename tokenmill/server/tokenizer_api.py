"""vLLM's tokenizer endpoints: POST /tokenize, POST /detokenize and (behind --enable-tokenizer-info-endpoint)
GET /tokenizer_info, which clients such as lm-evaluation-harness's remote tokenizer read."""

from __future__ import annotations

from typing import Any

from fastapi import Depends, FastAPI
from pydantic import BaseModel, ConfigDict, Field, model_validator

from tokenmill.server.errors import APIError
from tokenmill.server.protocol import ChatMessage, ChatTool, message_dict
from tokenmill.server.serving import Serving


class TokenizeRequest(BaseModel):
    """A prompt (`add_special_tokens` default true), or chat `messages` through the chat template (default
    false: the template writes them), as vLLM's TokenizeCompletionRequest / TokenizeChatRequest."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    tools: list[ChatTool] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]


def add_tokenizer_routes(app: FastAPI, serving: Serving, enable_info: bool) -> None:
    tokenizer, max_model_len = serving.tokenizer, serving.max_model_len

    @app.post("/tokenize", dependencies=[Depends(serving.check_api_key)])
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        serving.check_model(body.model)
        if body.messages is not None:
            tools = [t.function.model_dump(exclude_none=True) for t in body.tools or []]
            tokens = serving.encode_chat([message_dict(m) for m in body.messages], tools, body.add_generation_prompt,
                                         bool(body.add_special_tokens))
        else:
            assert body.prompt is not None
            add_special = True if body.add_special_tokens is None else body.add_special_tokens
            tokens = tokenizer.encode(body.prompt, add_special_tokens=add_special)
        return {"count": len(tokens), "max_model_len": max_model_len, "tokens": tokens,
                "token_strs": [tokenizer.id_to_token(t) for t in tokens] if body.return_token_strs else None}

    @app.post("/detokenize", dependencies=[Depends(serving.check_api_key)])
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        serving.check_model(body.model)
        bad = [t for t in body.tokens if not 0 <= t < tokenizer.vocab_size]
        if bad:
            raise APIError(400, f"token ids out of range [0, {tokenizer.vocab_size}): {bad[:5]}", param="tokens")
        return {"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)}

    if enable_info:
        @app.get("/tokenizer_info", dependencies=[Depends(serving.check_api_key)])
        async def tokenizer_info() -> dict[str, Any]:
            return {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": tokenizer.eos_token or None,
                    "bos_token": tokenizer.bos_token or None, "pad_token": None,
                    "add_bos_token": tokenizer.add_bos_token, "chat_template": tokenizer.chat_template or None,
                    "model_max_length": max_model_len, "vocab_size": tokenizer.vocab_size}
