"""What a request names to run under an adapter (vLLM's `LoRARequest`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """`lora_int_id` identifies the adapter's weights: two adapters (or one reloaded from another path) must
    never share an id, since prefix caching and the resident slots key on it."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be >= 1, got {self.lora_int_id}")

    @property
    def cache_salt(self) -> int:
        """Folded into a prompt's first block hash: KV computed under this adapter is its own (ints only, so
        every process hashes it alike)."""
        return hash((0x4C6F5241, self.lora_int_id))


class LoRAError(ValueError):
    """An adapter that cannot be served (the message says why)."""
