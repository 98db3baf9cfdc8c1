"""Shared fixtures. The oracle for model outputs is HF transformers running the same GGUF weights in float32."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from tokenmill.model.loader import bundled_model_path

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
# TOKENMILL_TEST_DEVICE=cuda runs the model tests (parity, batch invariance, equivalence) on a GPU.
DEVICE = os.environ.get("TOKENMILL_TEST_DEVICE", "cpu")
warnings.filterwarnings("ignore", category=DeprecationWarning)

LONG_PARAGRAPH = (
    "Continuous batching schedules work at the granularity of one model step: finished sequences leave the "
    "batch immediately and waiting ones take their place, so the accelerator never idles on padding. "
    "Paged attention stores the key-value cache in fixed-size blocks, which removes fragmentation. "
)

PLAIN_PROMPTS = [
    "Hi",
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "1, 2, 3, 4, 5,",
    "The quick brown fox",
    "Translate to French: I love programming.",
    "Q: What is the boiling point of water?\nA:",
    "import numpy as np\n\nx = np.",
    "Emoji test 🚀🔥 and unicode: naïve café, 東京",
    "List three colors:",
    "In 1969, humans",
    LONG_PARAGRAPH * 2,
    LONG_PARAGRAPH * 8 + "In short,",
    LONG_PARAGRAPH * 17 + "To summarize the paragraphs above:",
]
CHAT_PROMPTS = [
    [{"role": "user", "content": "What is the capital of Japan?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You are a terse assistant."}, {"role": "user", "content": "Explain gravity."}],
    [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "Hi! How can I help?"},
     {"role": "user", "content": "Tell me a joke."}],
    [{"role": "user", "content": "Summarize: " + LONG_PARAGRAPH * 4}],
    [{"role": "user", "content": "What is 12 * 12?"}],
]


@pytest.fixture(scope="session")
def model_path() -> str:
    return bundled_model_path()


@pytest.fixture(scope="session")
def hf_model(model_path: str):  # noqa: ANN201
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(model_path), gguf_file=os.path.basename(model_path), dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def hf_tokenizer(model_path: str):  # noqa: ANN201
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(model_path), gguf_file=os.path.basename(model_path))


@pytest.fixture(scope="session")
def loaded_model(model_path: str):  # noqa: ANN201
    from tokenmill.model.loader import load_model

    return load_model(model_path)


@pytest.fixture(scope="session")
def tokenizer(loaded_model):  # noqa: ANN001, ANN201
    from tokenmill.model.tokenizer import Tokenizer

    return Tokenizer.from_path(loaded_model.path, loaded_model.gguf_reader)


@pytest.fixture(scope="session")
def llm():  # noqa: ANN201
    from tokenmill import LLM

    return LLM(device=DEVICE, quantization="none")  # the exact float32 path: token parity with transformers


@pytest.fixture(scope="session")
def base_url():  # noqa: ANN201
    """One live `tokenmill serve` on loopback with the bundled model, shared by the server and bench tests."""
    from tokenmill.bench.server_process import live_server

    with live_server() as server:
        yield server.url
