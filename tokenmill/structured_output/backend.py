"""The grammar engine, llguidance: constraint -> grammar definition -> one matcher per request.

llguidance was chosen by measurement (docs/BENCHMARKS.md, "Structured outputs"): its compile and mask times are
a few percent of a decode step like xgrammar's, it has no dependencies (13 MB; xgrammar pulls transformers and
triton, ~1 GB, on x86-64 Linux), reads JSON schema, regex, Lark and GBNF, and its matcher rolls back, which is what
speculative decoding needs.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import llguidance

if TYPE_CHECKING:
    import torch

# Fixed separators, no free whitespace: see StructuredOutputsParams.disable_any_whitespace.
JSON_OPTIONS: dict[str, Any] = {
    "whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
}


def closed_objects(schema: Any) -> Any:
    """The schema with `additionalProperties: false` on every object that lists its properties and says nothing
    about others (vLLM's default grammar engine, xgrammar, does the same in its strict mode): JSON Schema's own
    default admits any extra key, and a small model then invents keys until max_tokens."""
    if isinstance(schema, list):
        return [closed_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: closed_objects(value) for key, value in schema.items()}
    says_nothing = not {"additionalProperties", "unevaluatedProperties"} & set(schema)
    if isinstance(schema.get("properties"), dict) and says_nothing:
        closed["additionalProperties"] = False
    return closed


def grammar_definition(kind: str, text: str) -> str:
    """llguidance's grammar for one constraint (StructuredOutputsParams.key()); ValueError with the library's
    message when the schema, regex or grammar is invalid."""
    if kind in ("json", "json_object"):
        schema = closed_objects(json.loads(text)) if kind == "json" else {"type": "object"}
        definition = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)  # type: ignore[arg-type]
    elif kind == "regex":
        definition = llguidance.LLMatcher.grammar_from_regex(text)
    elif kind == "choice":
        choices = json.loads(text)
        definition = llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    elif kind == "grammar":
        definition = llguidance.grammar_from("grammar", text)  # Lark, or GBNF converted to Lark
    else:
        raise ValueError(f"unknown structured outputs constraint {kind!r}")
    error = llguidance.LLMatcher.validate_grammar(definition)
    if error:
        raise ValueError(f"invalid {kind} constraint: {error.strip()}")
    return definition


class GrammarCompiler:
    """Builds matchers over the model's vocabulary (token bytes from the tokenizer's JSON)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.tokenizer = llguidance.LLTokenizer(text_added_tokens(tokenizer_json), n_vocab=vocab_size,
                                                eos_token=list(eos_token_ids))

    def compile(self, definition: str) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self.tokenizer, definition, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher


def text_added_tokens(tokenizer_json: str) -> str:
    """The tokenizer as llguidance should read it: added tokens that are not special (Qwen's `<tool_call>`) become
    plain vocabulary entries. llguidance treats every added token as special, and its mask then let such a token
    through where a grammar spells its text, while its matcher rejected it: the request broke its grammar. As
    plain tokens they spell their text (a grammar names a special token by id, `<[id]>`). Only pieces a BPE or
    WordPiece vocabulary writes as themselves are moved: printable ASCII without spaces."""
    if '"special":false' not in tokenizer_json and '"special": false' not in tokenizer_json:
        return tokenizer_json  # nothing to move: skip parsing (Gemma's tokenizer is 33 MB of JSON)
    data = json.loads(tokenizer_json)
    vocab = (data.get("model") or {}).get("vocab")
    if not isinstance(vocab, dict):
        return tokenizer_json
    kept = []
    for token in data.get("added_tokens") or []:
        content = token.get("content", "")
        if token.get("special") or not (content.isascii() and content.isprintable() and " " not in content):
            kept.append(token)
        elif vocab.setdefault(content, token["id"]) != token["id"]:
            kept.append(token)  # the vocabulary has this text under another id: leave it an added token
    if len(kept) == len(data.get("added_tokens") or []):
        return tokenizer_json
    data["added_tokens"] = kept
    return json.dumps(data, ensure_ascii=False)


class Grammar:
    """One request's position in its grammar: which tokens may come next, advanced by each emitted token."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    def accept(self, token_id: int) -> bool:
        return self.matcher.consume_token(token_id)

    def valid_prefix(self, token_ids: Sequence[int]) -> int:
        """How many of these tokens the grammar accepts in a row (without advancing)."""
        return self.matcher.validate_tokens(list(token_ids))

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into one row of an int32 bitmask (bit t of the row = token t)."""
        target = bitmask[row]
        self.matcher.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * target.element_size())

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and allows nothing more (the request ends here)."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str | None:
        return self.matcher.get_error() if self.matcher.is_error() else None
