"""The model runner's side of multi-LoRA: adapters in host memory, the resident slots, and each step's rows
by adapter."""

from __future__ import annotations

import numpy as np
import torch

from tokenmill.config import EngineConfig, ModelConfig
from tokenmill.core.outputs import ScheduledRequest
from tokenmill.lora.adapter import load_adapter
from tokenmill.lora.cache import AdapterCache
from tokenmill.lora.slots import LoRABatch, LoRAContext, LoRASlots


class LoRAManager:
    def __init__(self, config: EngineConfig, model: ModelConfig, device: torch.device,
                 rotary_order: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> None:
        max_rank = config.max_lora_rank
        self.max_loras = config.max_loras
        self.cache = AdapterCache(config.max_cpu_loras or config.max_loras,
                                  lambda request: load_adapter(request, model, max_rank, rotary_order))
        self.slots = LoRASlots(model, config.max_loras, max_rank, device, dtype)
        self.context = LoRAContext()
        self._steps = 0

    def prepare(self, scheduled: list[ScheduledRequest]) -> LoRABatch | None:
        """Make the step's adapters resident and group its rows by slot (None: no row has an adapter)."""
        loras = [s.lora_request for s in scheduled]
        distinct = {lora.lora_int_id: lora for lora in loras if lora is not None}
        if not distinct:
            self.context.batch = None
            return None
        self._steps += 1
        placed = self.slots.place(list(distinct.values()), self.cache.get, self._steps)
        slot_of_request = np.array([-1 if lora is None else placed[lora.lora_int_id] for lora in loras], np.int64)
        row_slots = np.repeat(slot_of_request, [s.num_tokens for s in scheduled])
        self.context.batch = LoRABatch.from_row_slots(row_slots)
        return self.context.batch

    def remove(self, lora_int_id: int) -> None:
        """Forget an unloaded adapter (its slot and host copy)."""
        self.slots.evict(lora_int_id)
        self.cache.remove(lora_int_id)
