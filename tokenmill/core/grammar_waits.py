"""Structured requests in the scheduler: those waiting for their grammar to compile step aside without holding
up the queue; running ones have their grammar advanced by each emitted token and mask their sampled rows.

With a reasoning parser, a request's grammar applies only after its reasoning ends (the reasoning-end token
sequence was emitted): the reasoning itself is free text, as in vLLM."""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tokenmill.core.request_queue import RequestQueue
from tokenmill.request import Request, RequestStatus
from tokenmill.structured_output.backend import Grammar
from tokenmill.structured_output.manager import StructuredOutputManager

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


class GrammarWaits:
    def __init__(self, manager: StructuredOutputManager | None,
                 reasoning_tags: tuple[Sequence[int], Sequence[int]] | None = None) -> None:
        self.manager = manager
        # the token ids that start and end a reasoning block ("<think>", "</think>"); None: no reasoning parser
        self.reasoning_tags = (list(reasoning_tags[0]), list(reasoning_tags[1])) if reasoning_tags else None
        self.compiling: list[Request] = []  # waiting requests whose grammar is not compiled yet
        # structured requests not yet admitted whose compilation has not been seen to succeed (arrival order):
        # the only ones a step must look at, however long the waiting queue
        self._unsettled: dict[str, Request] = {}

    def add(self, request: Request) -> None:
        constraint = request.sampling_params.structured_outputs
        if constraint is None:
            return
        if self.manager is None:
            raise ValueError("structured outputs are not available in this engine")
        request.structured = self.manager.start(constraint)
        # as vLLM's reasoning parsers judge it: the output starts inside reasoning unless the prompt closed its
        # last block (a template that turns thinking off writes an empty one)
        tags = self.reasoning_tags
        if tags is not None:
            prompt = request.prompt_token_ids
            request.structured.reasoning = not _last(prompt, tags[1]) > _last(prompt, tags[0])
        self._unsettled[request.request_id] = request

    def set_aside(self, waiting: RequestQueue) -> list[Request]:
        """Take out of the waiting queue the requests whose grammar is still compiling (kept in `compiling`, put
        back by `restore` after admission) and those whose compilation failed (returned: the caller aborts
        them)."""
        self.compiling = []
        failed = []
        for request_id, request in list(self._unsettled.items()):
            assert request.structured is not None
            if request.status != RequestStatus.WAITING:  # aborted before its grammar was ready
                del self._unsettled[request_id]
            elif not request.structured.ready:
                self.compiling.append(request)
            else:
                del self._unsettled[request_id]
                if request.structured.failure:
                    logger.error("request %s: %s", request.request_id, request.structured.failure)
                    failed.append(request)
                elif request.output_token_ids and self.replay(request) is not None:
                    failed.append(request)
        for request in self.compiling + failed:
            waiting.remove(request)
        return failed

    def restore(self, waiting: RequestQueue) -> None:
        for request in reversed(self.compiling):
            waiting.push_front(request)

    def wait_for_one(self, timeout: float) -> None:
        """Nothing else to run: block until a compilation finishes (or `timeout`), rather than spin."""
        if self.compiling:
            concurrent.futures.wait([r.structured.pending for r in self.compiling  # type: ignore[union-attr]
                                     ], timeout, concurrent.futures.FIRST_COMPLETED)

    @staticmethod
    def active_grammar(request: Request) -> Grammar | None:
        """The grammar that masks this request's next token: none before its reasoning ends."""
        structured = request.structured
        if structured is None or structured.reasoning:
            return None
        return structured.grammar

    def trim_proposals(self, request: Request) -> None:
        """A proposal the grammar rejects would be rejected anyway: do not verify it."""
        grammar = self.active_grammar(request)
        if request.spec_token_ids and grammar is not None:
            request.spec_token_ids = request.spec_token_ids[:grammar.valid_prefix(request.spec_token_ids)]

    def grammar_bitmask(self, rows: list[tuple[Grammar, Sequence[int]]]) -> torch.Tensor:
        assert self.manager is not None
        return self.manager.grammar_bitmask(rows)

    def replay(self, request: Request) -> RequestStatus | None:
        """A request resumed on this engine (engine/migration.py) arrives with tokens already emitted: bring its
        fresh grammar to the state they leave it in. Not None: they do not fit it, or already complete it (it
        would have ended), and the request cannot go on."""
        outputs = request.output_token_ids
        for i, token in enumerate(outputs):
            status = self._feed(request, token, outputs[:i + 1])
            if status is not None:
                logger.error("request %s: its %d emitted tokens do not replay through its grammar", request.request_id,
                             len(outputs))
                return status
        return None

    def advance(self, request: Request, token: int) -> RequestStatus | None:
        """Feed an emitted token to the request's grammar: a complete grammar ends the request (its EOS need not
        be generated); a token the grammar rejects (only possible if the mask was bypassed) ends it with an
        error. While
        the request reasons, the token only counts towards the end of its reasoning."""
        return self._feed(request, token, request.output_token_ids)

    def _feed(self, request: Request, token: int, emitted: Sequence[int]) -> RequestStatus | None:
        """`advance` with `emitted` the output up to and including `token`."""
        structured = request.structured
        assert structured is not None
        if structured.reasoning:
            assert self.reasoning_tags is not None
            end = self.reasoning_tags[1]
            if list(emitted[-len(end):]) == end:
                structured.reasoning = False  # the answer starts with the next token
            return None
        grammar = structured.grammar
        assert grammar is not None
        if not grammar.accept(token):
            logger.error("request %s: token %d does not match its grammar: %s", request.request_id, token,
                         grammar.error)
            request.error = f"the output broke its grammar at token {token}: {grammar.error}"
            return RequestStatus.FINISHED_ERROR
        return RequestStatus.FINISHED_STOPPED if grammar.is_terminated else None


def _last(tokens: Sequence[int], run: Sequence[int]) -> int:
    """Where `run` last occurs in `tokens` (-1: nowhere)."""
    n = len(run)
    return next((i for i in range(len(tokens) - n, -1, -1) if list(tokens[i:i + n]) == list(run)), -1)
