"""The other task's endpoints: a generative server answers the embedding endpoints, and an embedding server
(`--task embed`) the generation ones, with a 400 that says which server to start (torch-free: the generative
front end imports it)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI

from tokenmill.server.errors import APIError

EMBEDDING_PATHS = ("/v1/embeddings", "/rerank", "/v1/rerank", "/score", "/v1/score")
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages")


def refuse_embeddings(app: FastAPI, model_name: str, dependencies: Sequence[Any] = ()) -> None:
    async def refuse() -> None:
        raise APIError(400, f"the model {model_name} generates: embeddings, rerank and scores need a server "
                            "started with --task embed on an embedding model (BERT, nomic-bert)")

    for path in EMBEDDING_PATHS:
        app.post(path, dependencies=list(dependencies))(refuse)


def refuse_generation(app: FastAPI, model_name: str, dependencies: Sequence[Any] = ()) -> None:
    """(Routes of these paths already in the app, a decoder's, are taken out first.)"""
    app.router.routes = [r for r in app.router.routes if getattr(r, "path", None) not in GENERATION_PATHS]
    async def refuse() -> None:
        raise APIError(400, f"this server serves the embedding model {model_name} (--task embed): it answers "
                            "/v1/embeddings, /rerank and /score; generation needs a server on a generative model")

    for path in GENERATION_PATHS:
        app.post(path, dependencies=list(dependencies))(refuse)
