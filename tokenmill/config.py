"""Validated configuration: the model's shape and the engine's knobs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from tokenmill.model.rope_scaling import RopeScaling

BatchingMode = Literal["continuous", "dynamic", "static"]
SchedulingPolicy = Literal["fcfs", "priority"]


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a decoder of the Llama lineage and the options its families add (model/families.py says which
    family sets which): QK-norm (Qwen3, Gemma 3), norms around attention and MLP outputs (Gemma), GeGLU,
    scaled embeddings, sliding windows (Mistral, Gemma 3, with their own rope base on Gemma 3), rope scaling."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    qk_norm: bool = False  # RMSNorm over each head's q and k before rope
    sandwich_norm: bool = False  # RMSNorm on the attention and MLP outputs before each residual add
    hidden_act: str = "silu"  # the MLP's gate activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    embed_scale: float | None = None  # embeddings multiplied by this (Gemma: sqrt(hidden_size))
    attn_scale: float | None = None  # softmax scale; None: head_dim ** -0.5
    final_logit_softcapping: float | None = None
    sliding_window: int | None = None  # a windowed layer's query sees this many keys, itself included
    sliding_layers: tuple[int, ...] = ()  # the layers with the window
    rope_local_theta: float | None = None  # rope base of the windowed layers (Gemma 3), unscaled; None: rope_theta
    rotary_dim: int | None = None  # dims of each head that rotate (partial rotary, Phi-4-mini); None: head_dim

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.hidden_act not in ("silu", "gelu_tanh"):
            raise ValueError(f"hidden_act must be silu or gelu_tanh, got {self.hidden_act!r}")
        if self.sliding_layers and not self.sliding_window:
            raise ValueError("sliding_layers needs a sliding_window")
        if self.rotary_dim is not None and (self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim
                                            or (self.head_dim - self.rotary_dim) % 2):
            raise ValueError(f"rotary_dim {self.rotary_dim} must be even and at most head_dim {self.head_dim}")

    def window_of(self, layer: int) -> int | None:
        return self.sliding_window if layer in self.sliding_layers else None

    @property
    def max_context_len(self) -> int:
        """The longest sequence the model serves (dynamic NTK rope extends max_position_embeddings)."""
        return self.rope_scaling.context_length(self.max_position_embeddings)

    def rope_cache_key(self, prompt_len: int) -> int:
        """What a prompt's KV depends on besides its tokens (a prefix-cache salt): with length-dependent rope
        scaling (rope.py), whether the prompt outgrows the original context (longrope) or its very length
        (dynamic NTK); 0 when the tokens alone decide."""
        scaling = self.rope_scaling
        if not scaling.length_dependent or prompt_len <= scaling.length_threshold(self.max_position_embeddings):
            return 0
        return LONG_ROPE_CACHE_KEY if scaling.rope_type == "longrope" else prompt_len

    @property
    def softmax_scale(self) -> float:
        return self.head_dim**-0.5 if self.attn_scale is None else self.attn_scale



# ModelConfig.rope_cache_key of a longrope sequence past the original context (its KV rotated with the long
# factors); the scheduler salts a sequence that crosses it while generating the same way
LONG_ROPE_CACHE_KEY = 1
TASKS = ("auto", "generate", "embed")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8", "fp8", "fp8_e4m3", "fp8_e5m2")
LORA_DTYPES = ("auto", "float32", "bfloat16", "float16")
MAX_LORA_RANK = 256  # kernels/lora.c keeps a tile's rank-sized intermediates on the stack


@dataclass
class EngineConfig:
    """Knobs of the engine. `model=None` selects the bundled SmolLM2-135M-Instruct GGUF."""

    model: str | None = None
    # a Jinja chat template (a file or the template itself) instead of the model's (vLLM's --chat-template)
    chat_template: str | None = None
    # splits a reasoning model's <think> block from its answer (vLLM's --reasoning-parser: deepseek_r1, qwen3);
    # the engine starts a request's structured-output grammar after the block
    reasoning_parser: str | None = None
    device: str = "cpu"
    dtype: str = "float32"
    # Linear-layer weights (model/quant.py): "auto" picks the fastest mode this machine supports at start-up;
    # "none" keeps the float32 path that is token-exact with transformers.
    quantization: str = "auto"
    # KV cache element type (vLLM's --kv-cache-dtype): "auto" = bfloat16 where the linears are quantized and the
    # native attention kernel reads bf16 (half the bytes every decode step reads; measured on the quality gate),
    # else the model's dtype; "float32"/"bfloat16"/"float16" explicitly, or 8 bits with a scale per token and KV
    # head: "int8", "fp8" (= "fp8_e4m3"), "fp8_e5m2" (model/kv_quant.py).
    kv_cache_dtype: str = "auto"
    block_size: int = 16
    # KV cache size: an explicit block count wins over a memory budget.
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float = 1.0
    # on a GPU the KV pool takes what this share of the device's memory leaves once the weights are loaded
    # (vLLM's --gpu-memory-utilization); --num-kv-blocks wins over it
    gpu_memory_utilization: float = 0.9
    # GPU: decode steps run eagerly instead of replaying CUDA graphs captured at start-up (vLLM's --enforce-eager)
    enforce_eager: bool = False
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    # --target-itl-ms: while requests decode, prompt chunks get only the tokens that keep a step's predicted time
    # within this (core/token_budget.py); with none decoding, prompts get the whole max_num_batched_tokens
    target_itl_ms: float | None = None
    # a `tokenmill sim calibrate` profile (JSON) of this machine: the step-time predictor starts from it
    step_cost_profile: str | None = None
    max_num_partial_prefills: int = 2
    # off: a prompt is admitted only when all of it fits in a step's budget (encoders attend both ways, so their
    # inputs run whole); max_num_batched_tokens must then hold the longest prompt
    enable_chunked_prefill: bool = True
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    # KV tiers under the pool (kv_offload/): full prefix blocks evicted from the pool stay in host memory (this
    # many GB; 0: none) and in a directory that outlives the process (--kv-cache-dir, at most
    # kv_cache_dir_size_gb), and prompts read them back instead of prefilling them
    kv_offload_memory_gb: float = 0.0
    kv_cache_dir: str | None = None
    kv_cache_dir_size_gb: float = 16.0
    policy: SchedulingPolicy = "fcfs"
    # Priority units gained per second of waiting under the "priority" policy (aging against starvation).
    priority_aging_per_s: float = 1.0
    batching: BatchingMode = "continuous"
    seed: int = 0
    max_waiting_requests: int = 1024
    # Dynamo's --migration-limit: how often the front end moves a request to another engine core when its core
    # dies (engine/migration.py); 0: a dead core's requests fail
    migration_limit: int = 2
    # vLLM's shape: {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    # (a dict, a JSON string or a tokenmill.spec_decode.SpeculativeConfig); None: no speculation
    speculative_config: Any = None
    # Prefill/decode disaggregation (vLLM's kv_transfer_config roles): a "producer" engine runs prompts and
    # saves their KV blocks through a connector; a "consumer" loads them and decodes. None: colocated.
    kv_role: str | None = None
    kv_transport: str = "shm"  # "shm" (engines on one host) or "tcp"
    # Multi-LoRA (vLLM's flags): requests may name an adapter; up to max_loras of them resident (and running) at
    # once, each of rank <= max_lora_rank; max_cpu_loras kept in host memory (None: max_loras)
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # the adapters' weights in the resident slots (vLLM's --lora-dtype): "auto" = bfloat16 under quantized linears,
    # else the model's dtype
    lora_dtype: str = "auto"
    # What the model serves (vLLM's --task / --runner): "generate", or "embed" (embeddings, rerank and scores:
    # an encoder file such as BERT or nomic-bert, tokenmill/encoder/). "auto": what the model file is.
    task: str = "auto"
    # vLLM's --pooler-config for task "embed": {"pooling_type": "MEAN" | "CLS" | "LAST", "normalize": bool};
    # unset keys come from the model (GGUF pooling type, sentence-transformers' files)
    pooler_config: dict[str, Any] | None = None
    # vLLM's --hf-overrides, for task "embed": {"matryoshka_dimensions": [...]} or {"is_matryoshka": true}
    # declares truncated embeddings (`dimensions`) a model was trained for where its file does not say
    hf_overrides: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        def positive(name: str) -> None:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_num_partial_prefills",
                     "kv_cache_memory_gb", "max_waiting_requests"):
            positive(name)
        if self.num_kv_blocks is not None:
            positive("num_kv_blocks")
        if self.migration_limit < 0:
            raise ValueError(f"migration_limit must be >= 0, got {self.migration_limit}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_model_len is not None:
            positive("max_model_len")
        if self.target_itl_ms is not None:
            positive("target_itl_ms")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")
        if self.batching not in ("continuous", "dynamic", "static"):
            raise ValueError(f"batching must be 'continuous', 'dynamic' or 'static', got {self.batching!r}")
        if self.dtype not in ("float32", "float16", "bfloat16"):
            raise ValueError(f"dtype must be float32, float16 or bfloat16, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.quantization not in ("auto", "none", "int8", "bf16", "gguf"):
            raise ValueError(f"quantization must be auto, none, int8, bf16 or gguf, got {self.quantization!r}")
        if self.kv_role not in (None, "producer", "consumer"):
            raise ValueError(f"kv_role must be producer or consumer, got {self.kv_role!r}")
        if self.kv_transport not in ("shm", "tcp"):
            raise ValueError(f"kv_transport must be shm or tcp, got {self.kv_transport!r}")
        for name in ("max_loras", "max_lora_rank"):
            positive(name)
        if self.max_lora_rank > MAX_LORA_RANK:
            raise ValueError(f"max_lora_rank must be <= {MAX_LORA_RANK}, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        if self.lora_dtype not in LORA_DTYPES:
            raise ValueError(f"lora_dtype must be one of {LORA_DTYPES}, got {self.lora_dtype!r}")
        if self.enable_lora and self.kv_role is not None:
            raise ValueError("LoRA adapters are not supported with prefill/decode disaggregation")
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}, got {self.task!r}")
        if self.kv_offload_memory_gb < 0:
            raise ValueError(f"kv_offload_memory_gb must be >= 0, got {self.kv_offload_memory_gb}")
        positive("kv_cache_dir_size_gb")
        if (self.kv_offload_memory_gb or self.kv_cache_dir) and not self.enable_prefix_caching:
            raise ValueError("the KV tiers (kv_offload_memory_gb, kv_cache_dir) keep prefix-cache blocks: they "
                             "need prefix caching on")
        if self.priority_aging_per_s < 0:
            raise ValueError("priority_aging_per_s must be >= 0")
        from tokenmill.spec_decode.config import SpeculativeConfig

        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
