"""Structured outputs for one engine: constraints checked when a request arrives, grammars compiled off the
step loop (a worker thread; each distinct constraint once), and the bitmask of a step's constrained rows."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import llguidance
from tokenizers import Tokenizer as HFTokenizer

from tokenmill.structured_output.backend import Grammar, GrammarCompiler, grammar_definition

if TYPE_CHECKING:
    import torch
from tokenmill.structured_output.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# Distinct constraints remembered (definitions at the front end, compiled matchers in the engine).
CACHE_SIZE = 1024


class StructuredOutputRequest:
    """A request's grammar: compiling until `ready`, then its own matcher (a copy of the cached one)."""

    def __init__(self, compiled: Future[llguidance.LLMatcher]) -> None:
        self._compiled = compiled
        self.grammar: Grammar | None = None
        self.failure: str | None = None
        self.reasoning = False  # the output is still inside its reasoning: the grammar waits (core/grammar_waits.py)

    @property
    def ready(self) -> bool:
        """Compiled (or failed to: then `failure` says why)."""
        if self.grammar is None and self.failure is None and self._compiled.done():
            try:
                self.grammar = Grammar(self._compiled.result().deep_copy())
            except Exception as exc:  # noqa: BLE001 - reported with the request
                self.failure = f"grammar compilation failed: {exc}"
        return self.grammar is not None or self.failure is not None

    @property
    def pending(self) -> Future[llguidance.LLMatcher]:
        return self._compiled


# The vocabulary grammars are compiled over: the tokenizer and the EOS token ids. A callable, so that an engine
# core (whose front end tokenizes) reads its tokenizer only when it first compiles a grammar.
Vocabulary = Callable[[], tuple[HFTokenizer, Sequence[int]]]


class StructuredOutputManager:
    def __init__(self, vocabulary: Vocabulary, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._vocabulary = vocabulary
        # The vocabulary index, built in the worker for the first constraint (as vLLM builds its grammar backend):
        # it costs memory (200 MB for a 151k vocabulary, 470 MB for Gemma's 262k, the tokenizer included in an
        # engine core) that a server without constraints never pays. llguidance holds the GIL while it builds
        # (0.8 s, 2.5 s), so the engine's loop waits that long, once.
        self._compiler: GrammarCompiler | None = None
        self._definitions: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._definitions_lock = threading.Lock()
        self._compiled: OrderedDict[str, Future[llguidance.LLMatcher]] = OrderedDict()
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="tokenmill-grammar")

    # ------------------------------------------------------------ front end (any thread)

    def validate(self, params: StructuredOutputsParams) -> str:
        """The grammar definition for a constraint (cached); ValueError when it is invalid."""
        key = params.key()
        with self._definitions_lock:
            definition = self._definitions.get(key)
            if definition is not None:
                self._definitions.move_to_end(key)
                return definition
        definition = grammar_definition(*key)
        with self._definitions_lock:
            self._definitions[key] = definition
            if len(self._definitions) > CACHE_SIZE:
                self._definitions.popitem(last=False)
        return definition

    # ------------------------------------------------------------ engine (the step loop's thread)

    def start(self, params: StructuredOutputsParams) -> StructuredOutputRequest:
        """Compile the request's grammar in the worker, or reuse the compilation of an equal constraint."""
        definition = self.validate(params)
        compiled = self._compiled.get(definition)
        if compiled is None or (compiled.done() and compiled.exception() is not None):
            compiled = self._worker.submit(self._compile, definition)
            self._compiled[definition] = compiled
            if len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(definition)
        return StructuredOutputRequest(compiled)

    def _ensure_compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            tokenizer, eos_token_ids = self._vocabulary()
            self._compiler = GrammarCompiler(tokenizer.to_str(), self.vocab_size, eos_token_ids)
        return self._compiler

    def _compile(self, definition: str) -> llguidance.LLMatcher:
        return self._ensure_compiler().compile(definition)

    def grammar_bitmask(self, rows: Sequence[tuple[Grammar, Sequence[int]]]) -> torch.Tensor:
        """The bitmask for the constrained rows of a step, in order: for each (grammar, proposed tokens), the
        allowed tokens now and after each proposed token (the matcher steps through them and back)."""
        # imported here: the front end validates constraints with this class and never imports torch
        from tokenmill.structured_output.bitmask import allocate_bitmask

        bitmask = allocate_bitmask(sum(1 + len(proposed) for _, proposed in rows), self.vocab_size)
        row = 0
        for grammar, proposed in rows:
            grammar.fill_bitmask(bitmask, row)
            consumed = 0
            for token in proposed:
                # past the grammar's end the request stops anyway; and llguidance does not count a token
                # consumed after its end, so feeding it would make the rollback below undo one too many
                if not grammar.is_terminated:
                    grammar.accept(token)
                    consumed += 1
                row += 1
                grammar.fill_bitmask(bitmask, row)
            grammar.rollback(consumed)
            row += 1
        return bitmask

    def shutdown(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)
