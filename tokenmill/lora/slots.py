"""The resident adapters: a fixed pool of `max_loras` slots on the model's device, each projection's parts
pre-laid out to `max_lora_rank` (kernels/lora.c reads them in place), and the step's rows grouped by slot.

Slots are filled from the CPU cache (lora/cache.py) when a step needs an adapter that is not resident, evicting
the least recently used slot that this step does not use. The scheduler caps the distinct adapters among the
running requests at `max_loras`, so a step's adapters always fit."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from tokenmill import kernels
from tokenmill.config import MAX_LORA_RANK, ModelConfig
from tokenmill.lora.adapter import PART_NAMES, LoRAAdapter, part_shapes
from tokenmill.lora.request import LoRARequest

PROJECTIONS = ("qkv", "o", "gate_up", "down")


@dataclass
class LoRABatch:
    """A step's rows grouped by slot: rows[start[i]:start[i + 1]] run under slot[i]."""

    slot: np.ndarray
    start: np.ndarray
    rows: np.ndarray
    pointers: kernels.LoRABatchPointers

    @classmethod
    def from_row_slots(cls, row_slots: np.ndarray) -> LoRABatch | None:
        """row_slots [T]: each row's slot, -1 for rows of the base model. None when no row has an adapter."""
        rows = np.flatnonzero(row_slots >= 0)
        if not rows.size:
            return None
        rows = rows[np.argsort(row_slots[rows], kind="stable")].astype(np.int64)
        slots_sorted = row_slots[rows]
        boundaries = np.flatnonzero(np.diff(slots_sorted)) + 1
        start = np.concatenate([[0], boundaries, [rows.size]]).astype(np.int64)
        slot = slots_sorted[start[:-1]].astype(np.int64)
        pointers = kernels.LoRABatchPointers(slot.size, slot.ctypes.data, start.ctypes.data, rows.ctypes.data)
        return cls(slot, start, rows, pointers)


class ProjectionLoRA:
    """One projection's parts (q/k/v of qkv, gate/up of gate_up, or one) in every slot."""

    def __init__(self, parts: list[str], config: ModelConfig, num_slots: int, max_rank: int,
                 device: torch.device, dtype: torch.dtype = torch.float32) -> None:
        shapes = part_shapes(config)
        self.parts = parts
        self.in_features = shapes[parts[0]].in_features
        self.offset = np.array([shapes[p].offset for p in parts], np.int64)
        self.width = np.array([shapes[p].width for p in parts], np.int64)
        padded = -(-max_rank // 16) * 16  # the kernel computes the shrink 16 ranks at a time
        # At [slot, in, rank] (the shrink vectorizes across ranks), Bt [slot, rank, width]
        self.at = [torch.zeros(num_slots, self.in_features, padded, device=device, dtype=dtype) for _ in parts]
        self.bt = [torch.zeros(num_slots, padded, shapes[p].width, device=device, dtype=dtype) for p in parts]
        self.ranks = np.zeros((len(parts), num_slots), np.int32)  # 0: the slot's adapter skips the part
        self._at_ptrs = (ctypes.c_void_p * len(parts))(*(t.data_ptr() for t in self.at))
        self._bt_ptrs = (ctypes.c_void_p * len(parts))(*(t.data_ptr() for t in self.bt))
        self.pointers = kernels.LoRAWeightsPointers(
            len(parts), self.in_features, padded, self.offset.ctypes.data, self.width.ctypes.data,
            ctypes.addressof(self._at_ptrs), ctypes.addressof(self._bt_ptrs),
            self.ranks.ctypes.data, num_slots, int(dtype == torch.bfloat16))

    def fill(self, slot: int, layer: int, adapter: LoRAAdapter | None) -> None:
        for i, part in enumerate(self.parts):
            weights = None if adapter is None else adapter.parts.get((layer, part))
            if weights is None:
                self.ranks[i, slot] = 0
                continue
            a, bt = weights
            rank = a.shape[0]
            self.at[i][slot].zero_()  # the shrink reads up to the next multiple of 16 ranks
            self.at[i][slot, :, :rank].copy_(a.t())
            self.bt[i][slot, :rank].copy_(bt)
            self.ranks[i, slot] = rank

    def add(self, x: torch.Tensor, y: torch.Tensor, batch: LoRABatch) -> None:
        """y += each row's adapter delta (in place)."""
        if (kernels.lora_add_supported(x) and y.dtype == torch.float32 and y.stride(-1) == 1
                and self.at[0].dtype in (torch.float32, torch.bfloat16)):
            kernels.lora_add(self.pointers, batch.pointers, x if x.stride(-1) == 1 else x.contiguous(), y)
            return
        # the reference path (GPUs, other dtypes, no compiler): one pair of matmuls per slot and part
        for s, slot in enumerate(batch.slot):
            rows = torch.from_numpy(batch.rows[batch.start[s]:batch.start[s + 1]]).to(x.device)
            xs = x[rows].float()
            for i in range(len(self.parts)):
                rank = int(self.ranks[i, slot])
                if rank:
                    delta = (xs @ self.at[i][slot, :, :rank].float()) @ self.bt[i][slot, :rank].float()
                    columns = slice(int(self.offset[i]), int(self.offset[i] + self.width[i]))
                    y[rows, columns] += delta.to(y.dtype)


class LoRASlots:
    """The pool: per layer, per projection, the parts of every slot; which adapter each slot holds."""

    def __init__(self, config: ModelConfig, num_slots: int, max_rank: int, device: torch.device,
                 dtype: torch.dtype = torch.float32) -> None:
        if not 1 <= max_rank <= MAX_LORA_RANK:
            raise ValueError(f"max_lora_rank must be in [1, {MAX_LORA_RANK}], got {max_rank}")
        groups = {"qkv": ["q", "k", "v"], "o": ["o"], "gate_up": ["gate", "up"], "down": ["down"]}
        assert [p for g in groups.values() for p in g] == list(PART_NAMES)
        self.layers = [{name: ProjectionLoRA(parts, config, num_slots, max_rank, device, dtype)
                        for name, parts in groups.items()} for _ in range(config.num_layers)]
        self.holder: list[int | None] = [None] * num_slots  # lora_int_id in each slot
        self.last_used = [0] * num_slots
        self.loads = 0  # adapters copied into a slot since the start

    @property
    def num_slots(self) -> int:
        return len(self.holder)

    def slot_of(self, lora_int_id: int) -> int | None:
        return self.holder.index(lora_int_id) if lora_int_id in self.holder else None

    def place(self, requests: list[LoRARequest], fetch: Callable[[LoRARequest], LoRAAdapter],
              step: int) -> dict[int, int]:
        """Make the step's adapters (distinct) resident, fetching only those that are not; lora_int_id -> slot."""
        if len(requests) > self.num_slots:
            raise RuntimeError(f"a step needs {len(requests)} adapters; --max-loras is {self.num_slots}")
        wanted = {r.lora_int_id for r in requests}
        placed: dict[int, int] = {}
        for request in requests:
            lora_id = request.lora_int_id
            slot = self.slot_of(lora_id)
            if slot is None:
                free = [s for s in range(self.num_slots) if self.holder[s] not in wanted]
                slot = min(free, key=lambda s: (self.holder[s] is not None, self.last_used[s]))
                adapter = fetch(request)
                for layer, projections in enumerate(self.layers):
                    for projection in projections.values():
                        projection.fill(slot, layer, adapter)
                self.holder[slot] = lora_id
                self.loads += 1
            self.last_used[slot] = step
            placed[lora_id] = slot
        return placed

    def evict(self, lora_int_id: int) -> None:
        slot = self.slot_of(lora_int_id)
        if slot is not None:
            self.holder[slot] = None
            for projections in self.layers:
                for projection in projections.values():
                    projection.ranks[:, slot] = 0


class LoRAContext:
    """The step's batch, shared by every layer's hook (set by the model runner before the forward pass)."""

    def __init__(self) -> None:
        self.batch: LoRABatch | None = None


class LayerLoRA:
    """A decoder layer's view of the pool: adds the step's adapter deltas to its projections' outputs."""

    def __init__(self, projections: dict[str, ProjectionLoRA], context: LoRAContext) -> None:
        self.projections = projections
        self.context = context

    def add(self, projection: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        batch = self.context.batch
        if batch is not None:
            self.projections[projection].add(x, y, batch)
        return y
