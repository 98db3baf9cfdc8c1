"""The host-memory tier: evicted prefix blocks kept in process memory, least recently used out first."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TierBlock:
    token_ids: tuple[int, ...]  # the tokens the hash covers, compared on every hit (hashes can collide)
    data: torch.Tensor  # the block as the model runner reads it: [layers, 2 (K, V), elements]

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


class HostTier:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._blocks: OrderedDict[int, TierBlock] = OrderedDict()  # front: least recently used
        self.evictions = 0

    def __contains__(self, key: int) -> bool:
        return key in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def put(self, key: int, block: TierBlock) -> list[int]:
        """Keep `block`; returns the keys dropped to make room."""
        if block.nbytes > self.capacity_bytes:
            return [key]
        old = self._blocks.pop(key, None)
        if old is not None:
            self.used_bytes -= old.nbytes
        dropped_keys = []
        while self._blocks and self.used_bytes + block.nbytes > self.capacity_bytes:
            dropped_key, dropped = self._blocks.popitem(last=False)
            self.used_bytes -= dropped.nbytes
            self.evictions += 1
            dropped_keys.append(dropped_key)
        self._blocks[key] = block
        self.used_bytes += block.nbytes
        return dropped_keys

    def get(self, key: int, token_ids: tuple[int, ...]) -> TierBlock | None:
        block = self._blocks.get(key)
        if block is None or block.token_ids != token_ids:
            return None
        self._blocks.move_to_end(key)
        return block

    def matches(self, key: int, token_ids: tuple[int, ...]) -> bool:
        block = self._blocks.get(key)
        return block is not None and block.token_ids == token_ids
