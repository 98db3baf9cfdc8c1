"""The models behind the embedding endpoints (server/embeddings_api.py's EmbeddingBackend): an encoder's
embedding engine in this process, or a decoder served with --task embed through the engine cores, each input a
pooling request (SamplingParams.pool) that the scheduler runs like any prompt. Torch-free."""

from __future__ import annotations

import asyncio
import uuid
from typing import TYPE_CHECKING

import numpy as np

from tokenmill.encoder.inputs import EncoderInput, decoder_input
from tokenmill.encoder.pooling_options import decoder_pooling, l2_normalize
from tokenmill.engine.async_engine import AsyncLLM, EngineDeadError, EngineStepError, QueueFullError
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.errors import APIError

if TYPE_CHECKING:
    from tokenmill.encoder.engine import EmbeddingEngine
    from tokenmill.engine.request_stream import RequestStream

POOL = SamplingParams(max_tokens=1, temperature=0.0, pool=True)


class EncoderBackend:
    def __init__(self, engine: EmbeddingEngine) -> None:
        self.engine = engine
        self.normalize = engine.normalize
        self.matryoshka_dimensions = engine.config.matryoshka_dimensions
        self.cross_encoder = engine.config.is_cross_encoder

    def make_input(self, text: str | list[int], pair: str | None = None,
                   truncate_prompt_tokens: int | None = None) -> EncoderInput:
        return self.engine.make_input(text, pair, truncate_prompt_tokens)

    async def run(self, inputs: list[EncoderInput], classify: bool = False) -> np.ndarray:
        result = await asyncio.wrap_future(self.engine.submit(inputs, classify))
        return result.numpy()


class DecoderBackend:
    """Last-token pooling on a decoder: the final hidden state after each input's last token."""

    cross_encoder = False

    def __init__(self, llm: AsyncLLM, normalize: bool, matryoshka_dimensions: tuple[int, ...] | None) -> None:
        self.llm = llm
        self.normalize = normalize
        self.matryoshka_dimensions = matryoshka_dimensions

    def make_input(self, text: str | list[int], pair: str | None = None,
                   truncate_prompt_tokens: int | None = None) -> EncoderInput:
        if pair is not None:
            raise ValueError("a decoder embeds one text at a time (no cross-encoder pairs)")
        return decoder_input(self.llm.tokenizer, self.llm.processor.vocab_size, self.llm.max_model_len, text,
                             truncate_prompt_tokens)

    async def run(self, inputs: list[EncoderInput], classify: bool = False) -> np.ndarray:
        if classify:
            raise ValueError("this model has no classification head (not a cross-encoder)")
        batch = uuid.uuid4().hex
        streams: list[RequestStream] = []

        async def last(stream: RequestStream) -> list[float]:
            final = None
            async for output in stream:
                final = output
            if final is None or final.pooled is None:
                raise RuntimeError("the engine returned no embedding")
            return list(final.pooled)

        try:
            for i, item in enumerate(inputs):
                streams.append(self.llm.add_request(f"embd-{batch}-{i}", {"prompt_token_ids": item.token_ids},
                                                    POOL))
            vectors = np.array(await asyncio.gather(*(last(s) for s in streams)), dtype=np.float32)
        except QueueFullError as exc:
            raise APIError(429, str(exc), "rate_limit_exceeded", headers={"Retry-After": "1"}) from exc
        except EngineDeadError as exc:
            raise APIError(503, str(exc), "service_unavailable") from exc
        except EngineStepError as exc:
            raise APIError(500, str(exc), "internal_server_error") from exc
        finally:  # a failed or cancelled request leaves none of its inputs behind
            for stream in streams:
                stream.close()
        return l2_normalize(vectors) if self.normalize else vectors


def decoder_backend(llm: AsyncLLM) -> DecoderBackend:
    """The backend of a decoder served with --task embed, as its --pooler-config and --hf-overrides say."""
    model_config = llm.processor.model_config
    normalize, allowed = decoder_pooling(llm.config.pooler_config, llm.config.hf_overrides,
                                         model_config.hidden_size if model_config is not None else 0)
    return DecoderBackend(llm, normalize, allowed)
