"""The model behind the embedding endpoints (server/embeddings_api.py's EmbeddingBackend): embedding requests
through AsyncLLM's engine cores, each input a pooling request (SamplingParams.pool) that the scheduler runs like
any prompt: an encoder's inputs whole (with their token types; a cross-encoder's "classify" task gives its
logits), or a decoder's prompt with last-token pooling. Torch-free."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from tokenmill.encoder.inputs import EncoderInput, decoder_input
from tokenmill.encoder.pooling_options import decoder_pooling, l2_normalize
from tokenmill.engine.async_engine import AsyncLLM, EngineDeadError, EngineStepError, QueueFullError
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.errors import APIError

if TYPE_CHECKING:
    from tokenmill.encoder.front import EncoderFront
    from tokenmill.engine.request_stream import RequestStream
    from tokenmill.outputs import RequestOutput

EMBED = SamplingParams(max_tokens=1, temperature=0.0, pool=True)
CLASSIFY = SamplingParams(max_tokens=1, temperature=0.0, pool=True, pooling_task="classify")


class EngineBackend:
    def __init__(self, llm: AsyncLLM, normalize: bool, matryoshka_dimensions: tuple[int, ...] | None,
                 encoder: EncoderFront | None = None,
                 on_finished: Callable[[RequestOutput], None] | None = None) -> None:
        self.llm = llm
        self.on_finished = on_finished  # each input's final output (the server's metrics count it)
        self.normalize = normalize
        self.matryoshka_dimensions = matryoshka_dimensions
        self.encoder = encoder
        self.cross_encoder = encoder is not None and encoder.config.is_cross_encoder

    def make_input(self, text: str | list[int], pair: str | None = None,
                   truncate_prompt_tokens: int | None = None) -> EncoderInput:
        if self.encoder is not None:
            return self.encoder.make_input(text, pair, truncate_prompt_tokens)
        if pair is not None:
            raise ValueError("a decoder embeds one text at a time (no cross-encoder pairs)")
        return decoder_input(self.llm.tokenizer, self.llm.processor.vocab_size, self.llm.max_model_len, text,
                             truncate_prompt_tokens)

    async def run(self, inputs: list[EncoderInput], classify: bool = False) -> np.ndarray:
        """[inputs, hidden] embeddings (normalised where the model says), or [inputs, labels] logits."""
        if classify and not self.cross_encoder:
            raise ValueError("this model has no classification head (not a cross-encoder)")
        batch = uuid.uuid4().hex
        streams: list[RequestStream] = []
        # A request's inputs enter the engine a window at a time (what one step of each replica takes): a request of
        # thousands of inputs (OpenAI allows 2,048) neither fills the waiting queue nor gets a 429 for its size.
        window = asyncio.Semaphore(max(1, self.llm.config.max_num_seqs * len(self.llm.replicas)))

        async def embed_one(i: int, item: EncoderInput) -> list[float]:
            async with window:
                prompt: dict[str, Any] = {"prompt_token_ids": item.token_ids}
                if item.token_type_ids is not None:
                    prompt["token_type_ids"] = item.token_type_ids
                stream = self.llm.add_request(f"embd-{batch}-{i}", prompt, CLASSIFY if classify else EMBED)
                streams.append(stream)
                final = None
                async for output in stream:
                    final = output
            if final is None or final.pooled is None:
                raise RuntimeError("the engine returned no embedding")
            if self.on_finished is not None:
                self.on_finished(final)
            return list(final.pooled)

        tasks = [asyncio.ensure_future(embed_one(i, item)) for i, item in enumerate(inputs)]
        try:
            vectors = np.array(await asyncio.gather(*tasks), dtype=np.float32)
        except QueueFullError as exc:
            raise APIError(429, str(exc), "rate_limit_exceeded", headers={"Retry-After": "1"}) from exc
        except EngineDeadError as exc:
            raise APIError(503, str(exc), "service_unavailable") from exc
        except EngineStepError as exc:
            raise APIError(500, str(exc), "internal_server_error") from exc
        finally:  # a failed or cancelled request leaves none of its inputs behind
            for task in tasks:
                task.cancel()
            for stream in streams:
                stream.close()
        return l2_normalize(vectors) if self.normalize and not classify else vectors


def engine_backend(llm: AsyncLLM, on_finished: Callable[[RequestOutput], None] | None = None) -> EngineBackend:
    """The backend of a server with --task embed: an encoder's (its file's pooling and normalisation, or
    --pooler-config's), or a decoder's as its --pooler-config and --hf-overrides say."""
    encoder = llm.processor.encoder
    if encoder is not None:
        return EngineBackend(llm, encoder.normalize, encoder.config.matryoshka_dimensions, encoder, on_finished)
    model_config = llm.processor.model_config
    normalize, allowed = decoder_pooling(llm.config.pooler_config, llm.config.hf_overrides,
                                         model_config.hidden_size if model_config is not None else 0)
    return EngineBackend(llm, normalize, allowed, on_finished=on_finished)
