"""tokenmill: an LLM inference engine built around continuous batching."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenmill.beam_search import BeamSearchParams
    from tokenmill.config import EngineConfig
    from tokenmill.llm import LLM
    from tokenmill.lora.request import LoRARequest
    from tokenmill.outputs import CompletionOutput, RequestOutput
    from tokenmill.sampling_params import SamplingParams

__all__ = ["LLM", "BeamSearchParams", "CompletionOutput", "EngineConfig", "LoRARequest", "RequestOutput",
           "SamplingParams"]
__version__ = "0.1.0"

# Imported on first use, so that `tokenmill serve` can start its engine-core server before torch is imported.
_HOMES = {"LLM": "tokenmill.llm", "BeamSearchParams": "tokenmill.beam_search", "CompletionOutput": "tokenmill.outputs",
          "EngineConfig": "tokenmill.config", "LoRARequest": "tokenmill.lora.request",
          "RequestOutput": "tokenmill.outputs", "SamplingParams": "tokenmill.sampling_params"}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'tokenmill' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
