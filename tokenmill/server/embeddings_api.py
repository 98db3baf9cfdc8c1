"""Embeddings, reranking and scores over a model that embeds (an encoder, or a decoder with --task embed): OpenAI's
`POST /v1/embeddings`, the Jina/Cohere shape of `POST /rerank` and `/v1/rerank`, and vLLM's `POST /score`.

A server started with `--task embed` serves these; server/task_routes.py answers the other task's endpoints.
"""

from __future__ import annotations

import base64
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Literal, Protocol, cast

import numpy as np
from fastapi import Depends, FastAPI
from pydantic import BaseModel, ConfigDict, Field, field_validator

from tokenmill.encoder.inputs import EncoderInput
from tokenmill.encoder.pooling_options import cosine_scores, cross_encoder_scores, truncate_dimensions
from tokenmill.server.errors import APIError
from tokenmill.server.task_routes import refuse_generation


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None  # vLLM's: keep the first N tokens instead of refusing a long input

    @field_validator("input")
    @classmethod
    def _not_empty(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise ValueError("input is an empty list")
        return value


class RerankDocument(BaseModel):
    text: str


class RerankRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    query: str
    documents: list[str | RerankDocument] = Field(min_length=1)
    top_n: int | None = Field(None, ge=1)
    return_documents: bool = True
    truncate_prompt_tokens: int | None = None


class ScoreRequest(BaseModel):
    """vLLM's: one text_1 against each text_2, or text_1[i] against text_2[i]."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: int | None = None


class EmbeddingBackend(Protocol):
    """What the endpoints need of a model that embeds (server/embedding_backends.py: an encoder's engine, or a
    decoder's engine cores)."""

    normalize: bool
    matryoshka_dimensions: tuple[int, ...] | None
    cross_encoder: bool

    def make_input(self, text: str | list[int], pair: str | None = None,
                   truncate_prompt_tokens: int | None = None) -> EncoderInput: ...

    async def run(self, inputs: list[EncoderInput], classify: bool = False) -> np.ndarray: ...


def _usage(tokens: int) -> dict[str, int]:
    return {"prompt_tokens": tokens, "total_tokens": tokens}


def _encode_vector(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":  # little-endian float32, as OpenAI's API and client
        return base64.b64encode(vector.astype("<f4").tobytes()).decode()
    return [float(v) for v in vector]


class EmbeddingServing:
    """The endpoints' work over one backend: inputs checked and tokenized, run, shaped."""

    def __init__(self, backend: EmbeddingBackend, model_name: str) -> None:
        self.backend = backend
        self.model_name = model_name

    def inputs(self, texts: list[str | list[int]], pairs: list[str] | None = None,
               truncate: int | None = None) -> list[EncoderInput]:
        try:
            return [self.backend.make_input(t, None if pairs is None else pairs[i], truncate)
                    for i, t in enumerate(texts)]
        except ValueError as exc:
            raise APIError(400, str(exc), param="input") from exc

    async def run(self, inputs: list[EncoderInput], classify: bool = False) -> np.ndarray:
        try:
            return await self.backend.run(inputs, classify)
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc

    async def embed(self, body: EmbeddingRequest) -> dict[str, Any]:
        raw = body.input
        texts = cast(list[str | list[int]],
                     [raw] if isinstance(raw, str) or isinstance(raw[0], int) else list(raw))
        inputs = self.inputs(texts, truncate=body.truncate_prompt_tokens)
        vectors = await self.run(inputs)
        try:
            vectors = truncate_dimensions(vectors, body.dimensions, self.backend.matryoshka_dimensions,
                                          self.backend.normalize)
        except ValueError as exc:
            raise APIError(400, str(exc), param="dimensions") from exc
        tokens = sum(len(i.token_ids) for i in inputs)
        return {"id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                "model": self.model_name, "usage": _usage(tokens),
                "data": [{"object": "embedding", "index": i, "embedding": _encode_vector(v, body.encoding_format)}
                         for i, v in enumerate(vectors)]}

    async def scores(self, queries: list[str], documents: list[str], truncate: int | None) -> tuple[list[float], int]:
        """Relevance of documents[i] to queries[i]: a cross-encoder's (sigmoid of its logit over the pair) or
        the cosine similarity of the two embeddings; and the tokens read."""
        if self.backend.cross_encoder:
            inputs = self.inputs(list(queries), documents, truncate)
            logits = await self.run(inputs, classify=True)
            return cross_encoder_scores(logits), sum(len(i.token_ids) for i in inputs)
        row = {q: i for i, q in enumerate(dict.fromkeys(queries))}  # one query against many documents: embedded once
        inputs = self.inputs([*row, *documents], truncate=truncate)
        vectors = await self.run(inputs)
        scores = cosine_scores(vectors[[row[q] for q in queries]], vectors[len(row):])
        return scores, sum(len(i.token_ids) for i in inputs)

    async def rerank(self, body: RerankRequest) -> dict[str, Any]:
        documents = [d if isinstance(d, str) else d.text for d in body.documents]
        scores, tokens = await self.scores([body.query] * len(documents), documents, body.truncate_prompt_tokens)
        order = sorted(range(len(documents)), key=lambda i: -scores[i])[:body.top_n or len(documents)]
        return {"id": f"rerank-{uuid.uuid4().hex}", "model": self.model_name, "usage": {"total_tokens": tokens},
                "results": [{"index": i, "relevance_score": scores[i],
                             **({"document": {"text": documents[i]}} if body.return_documents else {})}
                            for i in order]}

    async def score(self, body: ScoreRequest) -> dict[str, Any]:
        first = [body.text_1] if isinstance(body.text_1, str) else body.text_1
        second = [body.text_2] if isinstance(body.text_2, str) else body.text_2
        if not first or not second:
            raise APIError(400, "text_1 and text_2 must not be empty lists")
        if len(first) == 1:
            first = first * len(second)
        elif len(first) != len(second):
            raise APIError(400, f"text_1 has {len(first)} items and text_2 {len(second)}: give one text_1, or as "
                                "many as text_2", param="text_2")
        scores, tokens = await self.scores(first, second, body.truncate_prompt_tokens)
        return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                "model": self.model_name, "usage": _usage(tokens),
                "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]}


def add_embedding_routes(app: FastAPI, serving: EmbeddingServing, check_api_key: Callable[..., Awaitable[None]],
                         check_model: Callable[[str | None], Any]) -> None:
    auth = [Depends(check_api_key)]

    @app.post("/v1/embeddings", dependencies=auth)
    async def embeddings(body: EmbeddingRequest) -> dict[str, Any]:
        check_model(body.model)
        return await serving.embed(body)

    async def rerank(body: RerankRequest) -> dict[str, Any]:
        check_model(body.model)
        return await serving.rerank(body)

    async def score(body: ScoreRequest) -> dict[str, Any]:
        check_model(body.model)
        return await serving.score(body)

    for path in ("/rerank", "/v1/rerank"):
        app.post(path, dependencies=auth)(rerank)
    for path in ("/score", "/v1/score"):
        app.post(path, dependencies=auth)(score)
    refuse_generation(app, serving.model_name, auth)
