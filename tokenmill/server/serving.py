"""What an API module (Anthropic Messages, Responses, tokenizer endpoints) needs of the server: the model's
name and tokenizer, the chat template with tools, and one call that runs prompts through the engine and
answers with the module's own body or event stream."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from tokenmill.lora.request import LoRARequest
from tokenmill.model.tokenizer import Tokenizer
from tokenmill.reasoning import ReasoningParser
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.errors import APIError
from tokenmill.server.responses import StreamBuilder
from tokenmill.server.tools import forced_call_constraint
from tokenmill.structured_output.params import StructuredOutputsParams
from tokenmill.tool_parsers import Spell, ToolParser
from tokenmill.tool_parsers.base import quoted
from tokenmill.tool_parsers.hermes import HermesParser

# (builder, prompts, params, priority, stream, the HTTP request, the adapter or None) -> the response
ServeFn = Callable[[StreamBuilder, list[Any], SamplingParams, int, bool, Request, LoRARequest | None],
                   Awaitable[Response]]


@dataclass
class Serving:
    model_name: str
    tokenizer: Tokenizer
    max_model_len: int
    serve: ServeFn
    # (messages in the chat API's shape, tool definitions, add_generation_prompt, add_special_tokens) -> prompt
    # token ids (APIError 400 if the template fails)
    encode_chat: Callable[..., list[int]]
    auto_tool_choice: bool  # --enable-auto-tool-choice with a --tool-call-parser: "auto" can parse calls
    check_api_key: Callable[..., Any]
    # a request's `model` -> the adapter it names (None: the base model); APIError 404 for an unknown one
    check_model: Callable[[str | None], LoRARequest | None]
    reasoning: ReasoningParser | None = None  # --reasoning-parser: the <think> block is split from the answer
    tool_parser: type[ToolParser] = HermesParser  # --tool-call-parser (or the chat template's format)
    strict_tool_calls: bool = False  # --tool-call-parser-strict: no lenient reading of loose calls
    spell: Spell = quoted  # how forced-call grammars name the parser's markers for this tokenizer
    # the parser's markers are special tokens of this tokenizer: outputs that may hold calls keep them
    keep_special_tokens: bool = False

    def served_name(self, lora: LoRARequest | None) -> str:
        """The `model` a response reports: the adapter's name when one ran."""
        return self.model_name if lora is None else lora.lora_name

    def check_tool_mode(self, tool_mode: str, param: str = "tool_choice") -> None:
        if tool_mode == "auto" and not self.auto_tool_choice:
            raise APIError(400, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be '
                                'set', param=param)


    def parser_for(self, tool_mode: str, tools: Sequence[dict[str, Any]]) -> ToolParser | None:
        """The parser of a request's output: None when it cannot hold calls (tool mode none)."""
        return None if tool_mode == "none" else self.tool_parser(tools, lenient=not self.strict_tool_calls)

    def tool_constraint(self, tool_mode: str, tools: Sequence[dict[str, Any]], named: str | None, parallel: bool,
                        requested: StructuredOutputsParams | None) -> StructuredOutputsParams | None:
        """The grammar of a forced call (tool mode required or named), or the request's own constraint."""
        if tool_mode not in ("required", "named"):
            return requested
        if requested is not None:
            raise ValueError("a forced tool call cannot be combined with another structured outputs constraint")
        return forced_call_constraint(self.tool_parser(tools), tools, named if tool_mode == "named" else None,
                                      parallel, self.spell)

    def with_tools(self, params: SamplingParams, tool_mode: str) -> SamplingParams:
        """The request's parameters, keeping special tokens in the text where they mark calls."""
        if tool_mode != "none" and self.keep_special_tokens:
            params.skip_special_tokens = False
        return params


def params_or_400(make: Callable[[], SamplingParams]) -> SamplingParams:
    try:
        return make()
    except ValueError as exc:
        raise APIError(400, str(exc)) from exc
