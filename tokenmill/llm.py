"""Offline inference in vLLM's shape: `LLM(model).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import fields
from typing import Any, cast

import numpy as np

from tokenmill.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams, run_beam_searches
from tokenmill.config import EngineConfig
from tokenmill.encoder.config import resolve_task
from tokenmill.encoder.engine import EmbeddingEngine
from tokenmill.encoder.inputs import decoder_input
from tokenmill.encoder.pooling_options import (
    cosine_scores,
    cross_encoder_scores,
    decoder_pooling,
    l2_normalize,
    truncate_dimensions,
)
from tokenmill.engine.llm_engine import LLMEngine, PromptType
from tokenmill.lora.request import LoRARequest
from tokenmill.model.metadata import resolve_model_path
from tokenmill.model.tokenizer import Tokenizer
from tokenmill.outputs import (
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from tokenmill.sampling_params import SamplingParams

Conversation = list[dict[str, Any]]
POOL = SamplingParams(max_tokens=1, temperature=0.0, pool=True)


class LLM:
    """`LLM(model)` generates; `LLM(model, task="embed")` (an encoder file: also "auto") embeds and scores."""

    def __init__(self, model: str | None = None, *, config: EngineConfig | None = None, **engine_args: Any) -> None:
        if config is None:
            known = {f.name for f in fields(EngineConfig)}
            unknown = set(engine_args) - known
            if unknown:
                raise TypeError(f"unknown engine arguments: {sorted(unknown)}")
            config = EngineConfig(model=model, **engine_args)
        # request ids never repeat (vLLM's counter): an id reused by the next generate() call could meet state its
        # finished namesake left behind
        self._request_counter = itertools.count()
        self.task, encoder = resolve_task(resolve_model_path(config.model), config.task)
        # an encoder embeds in its own engine; a decoder (generating or embedding) runs in the LLM engine
        self.embedder: EmbeddingEngine | None = None
        if encoder:
            self.embedder = EmbeddingEngine(config)
        else:
            self._engine = LLMEngine.from_config(config)
            if self.task == "embed":
                model_config = self._engine.processor.model_config
                self._decoder_pooling = decoder_pooling(config.pooler_config, config.hf_overrides,
                                                        model_config.hidden_size if model_config else 0)

    @property
    def engine(self) -> LLMEngine:
        if self.embedder is not None:
            raise ValueError("this LLM embeds with an encoder (task='embed'): use embed() and score()")
        return self._engine

    def close(self) -> None:
        """Write what the KV tiers should keep across restarts (`kv_cache_dir`) and stop their threads."""
        if self.embedder is not None:
            self.embedder.shutdown()
            return
        self.engine.core.close()

    def embed(self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
              truncate_prompt_tokens: int | None = None, dimensions: int | None = None
              ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (text, or token ids taken as they are), pooled as the model says (a decoder:
        its last token's final hidden state, each prompt a request through the scheduler)."""
        if self.task != "embed":
            raise ValueError("this LLM generates: embeddings need LLM(model, task='embed') on an embedding model")
        texts = cast(list[str | list[int]], [prompts] if isinstance(prompts, str) or
                     (prompts and isinstance(prompts[0], int)) else list(prompts))
        if self.embedder is not None:
            embedder = self.embedder
            inputs = [embedder.make_input(t, truncate_prompt_tokens=truncate_prompt_tokens) for t in texts]
            vectors = embedder.submit(inputs).result().numpy()
            normalize, allowed = embedder.normalize, embedder.config.matryoshka_dimensions
        else:
            normalize, allowed = self._decoder_pooling
            engine = self._engine
            inputs = [decoder_input(engine.tokenizer, engine.processor.vocab_size, engine.max_model_len, t,
                                    truncate_prompt_tokens) for t in texts]
            outputs = self.generate([{"prompt_token_ids": i.token_ids} for i in inputs], POOL)
            vectors = np.array([o.pooled for o in outputs], dtype=np.float32)
            vectors = l2_normalize(vectors) if normalize else vectors
        vectors = truncate_dimensions(vectors, dimensions, allowed, normalize)
        return [EmbeddingRequestOutput(f"embd-{i}", inputs[i].token_ids, EmbeddingOutput(vector.tolist()))
                for i, vector in enumerate(vectors)]

    def score(self, text_1: str, text_2: str | Sequence[str], truncate_prompt_tokens: int | None = None
              ) -> list[ScoringRequestOutput]:
        """How relevant each of `text_2` is to `text_1` (vLLM's LLM.score): a cross-encoder's score, else the
        cosine similarity of the embeddings."""
        documents = [text_2] if isinstance(text_2, str) else list(text_2)
        embedder = self.embedder
        if embedder is not None and embedder.config.is_cross_encoder:
            pairs = [embedder.make_input(text_1, d, truncate_prompt_tokens) for d in documents]
            scores = cross_encoder_scores(embedder.submit(pairs, classify=True).result().numpy())
        else:
            vectors = np.array([o.outputs.embedding for o in self.embed([text_1, *documents],
                                                                         truncate_prompt_tokens)])
            scores = cosine_scores(vectors[:1], vectors[1:])
        return [ScoringRequestOutput(f"score-{i}", ScoringOutput(s)) for i, s in enumerate(scores)]

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False, priority: Sequence[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """`lora_request`: one adapter for every prompt, or one (or None: the base model) per prompt; the engine
        needs `enable_lora=True`."""
        prompt_list = _prompt_list(prompts)
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras: list[LoRARequest | None] = [lora_request] * len(prompt_list)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompt_list):
                raise ValueError("give one LoRARequest or one per prompt")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError("give one SamplingParams or one per prompt")
        ids = []
        for i, (prompt, params) in enumerate(zip(prompt_list, params_list)):
            ids.append(self.engine.add_request(f"offline-{id(self)}-{next(self._request_counter)}", prompt, params,
                                               priority=priority[i] if priority else 0, lora_request=loras[i]))
        return self._run(ids, use_tqdm)

    def beam_search(self, prompts: PromptType | Sequence[PromptType],
                    params: BeamSearchParams) -> list[BeamSearchOutput]:
        """vLLM's `LLM.beam_search`: the `beam_width` best continuations of each prompt (tokenmill/beam_search.py),
        best first; each sequence holds its generated tokens and their text."""
        tokenize = self.engine.processor.tokenize_prompt
        searches = [BeamSearch(tokenize(p)[1], params, self.engine.eos_token_ids) for p in _prompt_list(prompts)]

        def next_tokens(sequences: list[list[int]], count: int) -> list[dict[int, float]]:
            step = SamplingParams(max_tokens=1, temperature=0.0, logprobs=count, ignore_eos=True)
            outputs = self.generate([{"prompt_token_ids": s} for s in sequences], step)
            return [output.outputs[0].logprobs[0] for output in outputs]  # type: ignore[index]

        run_beam_searches(searches, next_tokens)
        results = []
        for search in searches:
            sequences = search.result()
            for sequence in sequences:
                sequence.text = self.tokenizer.decode(sequence.tokens)
            results.append(BeamSearchOutput(sequences))
        return results

    def chat(self, messages: Conversation | Sequence[Conversation],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = False, lora_request: LoRARequest | None = None,
             tools: Sequence[dict[str, Any]] | None = None) -> list[RequestOutput]:
        """`tools` (vLLM's: OpenAI tool definitions) go to the chat template, which lists them to the model."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        extra = {"tools": list(tools)} if tools else {}
        prompts = [{"prompt_token_ids": self.tokenizer.encode_chat(c, **extra)}  # type: ignore[arg-type]
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        progress = _Progress(len(ids)) if use_tqdm else None
        try:
            while len(finished) < len(ids) and self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if progress:
                        progress.tokens(sum(len(c.delta_token_ids) for c in output.outputs))
                    if output.finished:
                        finished[output.request_id] = output
                        if progress:
                            progress.done()
        finally:
            if progress:
                progress.close()
        return [finished[i] for i in ids if i in finished]


def _prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    """One prompt (text, token ids or dict) or a sequence of them -> a list of prompts."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if prompts and isinstance(prompts[0], int):
        return [cast(Sequence[int], prompts)]
    return list(cast(Sequence[PromptType], prompts))


class _Progress:
    """A rich progress bar with requests done and output tokens/s."""

    def __init__(self, total: int) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._bar = Progress(TextColumn("generating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                             TextColumn("{task.fields[rate]}"), transient=False)
        self._task = self._bar.add_task("gen", total=total, rate="")
        self._tokens = 0
        self._bar.start()
        self._start = time.perf_counter()

    def tokens(self, count: int) -> None:
        self._tokens += count
        elapsed = max(time.perf_counter() - self._start, 1e-9)
        self._bar.update(self._task, rate=f"{self._tokens / elapsed:.1f} tok/s")

    def done(self) -> None:
        self._bar.advance(self._task)

    def close(self) -> None:
        self._bar.stop()
