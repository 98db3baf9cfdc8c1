"""LoRA adapters served beside the base model: PEFT checkpoints, a fixed pool of resident slots, and the
per-row low-rank additions of a mixed batch (Punica's segmented shape)."""

from tokenmill.lora.request import LoRARequest

__all__ = ["LoRARequest"]
