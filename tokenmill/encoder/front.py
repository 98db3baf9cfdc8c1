"""What the front end of an encoder needs, without its weights (torch-free: an API server process reads it while
the engine cores load the model): the model's config with its pooling, the tokenizer and the input checks."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, replace

from tokenmill.config import EngineConfig
from tokenmill.encoder.config import EncoderConfig, Pooling, embedding_kind, read_encoder_config
from tokenmill.encoder.inputs import EncoderInput, checked_input
from tokenmill.encoder.pooling_options import matryoshka_dimensions, pooler_options
from tokenmill.encoder.tokenizer import EncoderTokenizer
from tokenmill.model.gguf_file import GGUFFile
from tokenmill.model.metadata import resolve_model_path

TextOrTokens = str | Sequence[int]


@dataclass
class EncoderFront:
    path: str
    config: EncoderConfig  # matryoshka dimensions as the file or --hf-overrides say
    pooling: Pooling  # the file's, or --pooler-config's
    normalize: bool
    tokenizer: EncoderTokenizer
    max_model_len: int  # the longest input, in tokens

    def make_input(self, text: TextOrTokens, pair: str | None = None,
                   truncate_prompt_tokens: int | None = None) -> EncoderInput:
        """Tokenize one input (token ids are taken as they are); ValueError for an empty or over-long one."""
        if isinstance(text, str):
            if not text:
                raise ValueError("an input is an empty string")
            ids, types = self.tokenizer.encode(text, pair)
            return checked_input(ids, types, self.config.vocab_size, self.max_model_len, truncate_prompt_tokens,
                                 keep_last=True)
        return checked_input([int(t) for t in text], None, self.config.vocab_size, self.max_model_len,
                             truncate_prompt_tokens, keep_last=False)


def read_encoder_front(config: EngineConfig, reader: GGUFFile | None = None) -> EncoderFront:
    """`reader`: the GGUF file already opened (one header read for config, vocabulary and, later, tensors)."""
    path = resolve_model_path(config.model)
    if reader is None and not os.path.isdir(path):
        reader = GGUFFile(path)
    model_config = read_encoder_config(path, reader)
    model_config = replace(model_config, matryoshka_dimensions=matryoshka_dimensions(
        config.hf_overrides, model_config.hidden_size, model_config.matryoshka_dimensions))
    options = pooler_options(config.pooler_config)
    max_model_len = min(config.max_model_len or model_config.max_position_embeddings,
                        model_config.max_position_embeddings)
    return EncoderFront(path, model_config, options.get("pooling_type", model_config.pooling),
                        options.get("normalize", model_config.normalize), EncoderTokenizer.from_path(path, reader),
                        max_model_len)


def serves_encoder(config: EngineConfig) -> bool:
    """Whether an encoder serves `config` (task embed on an encoder file: one read of the file's header)."""
    return config.task == "embed" and embedding_kind(resolve_model_path(config.model)) == "encoder"


def encoder_core_config(config: EngineConfig, max_model_len: int) -> EngineConfig:
    """The engine config an encoder's core runs under: inputs whole (chunked prefill off, the budget at least
    the longest input), from no cache (an encoder's states depend on the whole input), continuous batching;
    nothing of KV tiers, disaggregation, speculation or a per-step time target applies to it."""
    return replace(config, enable_chunked_prefill=False, enable_prefix_caching=False, batching="continuous",
                   max_num_batched_tokens=max(config.max_num_batched_tokens, max_model_len),
                   kv_offload_memory_gb=0.0, kv_cache_dir=None, kv_role=None, speculative_config=None,
                   target_itl_ms=None)
