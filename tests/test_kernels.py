"""The native CPU attention kernel against the torch reference path it replaces, and its batch invariance."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from tokenmill import kernels
from tokenmill.model import attention
from tokenmill.model.attention import AttentionMetadata, allocate_kv_cache, paged_attention, write_kv

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None and shutil.which("cc") is None,
                                reason="no C compiler on this machine: the torch fallback serves instead")
CPU = torch.device("cpu")


class Batch:
    """A flat batch over a paged cache whose context K/V are random and whose blocks are shuffled."""

    def __init__(self, seed: int, heads: int, kv_heads: int, head_dim: int, block_size: int,
                 seqs: list[tuple[int, int]]) -> None:  # (query tokens, context length after the step)
        gen = torch.Generator().manual_seed(seed)
        self.heads, self.block_size, self.seqs = heads, block_size, seqs
        max_blocks = max(-(-n // block_size) for _, n in seqs)
        num_blocks = len(seqs) * max_blocks + 2
        self.k_cache, self.v_cache = allocate_kv_cache(num_blocks, block_size, kv_heads, head_dim, torch.float32, CPU)
        self.k_cache.normal_(generator=gen)
        self.v_cache.normal_(generator=gen)
        order = np.random.RandomState(seed).permutation(num_blocks)[: len(seqs) * max_blocks]
        self.tables = order.reshape(len(seqs), max_blocks).astype(np.int64)
        tokens = sum(q for q, _ in seqs)
        self.q = torch.randn(tokens, heads, head_dim, generator=gen)
        self.k = torch.randn(tokens, kv_heads, head_dim, generator=gen)
        self.v = torch.randn(tokens, kv_heads, head_dim, generator=gen)

    def meta(self, seqs: list[tuple[int, int]] | None = None, tables: np.ndarray | None = None) -> AttentionMetadata:
        seqs = seqs or self.seqs
        tables = self.tables if tables is None else tables
        slots = [tables[i, p // self.block_size] * self.block_size + p % self.block_size
                 for i, (q_len, n) in enumerate(seqs) for p in range(n - q_len, n)]
        query_lens, seq_lens = (np.array(column, np.int64) for column in zip(*seqs))
        return AttentionMetadata.build(query_lens, seq_lens, tables, np.array(slots, np.int64), self.block_size, CPU)

    def run(self, meta: AttentionMetadata, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        write_kv(self.k_cache, self.v_cache, k, v, meta.slot_mapping)
        return paged_attention(q, k, v, self.k_cache, self.v_cache, meta, q.shape[-1] ** -0.5)


SHAPES = [
    (9, 3, 64, 16, [(1, 1), (1, 17), (1, 300), (7, 7), (5, 40), (64, 100), (1, 16)]),  # SmolLM2; block edges
    (8, 8, 128, 32, [(3, 3), (1, 200), (40, 90)]),  # no GQA, another block size and head size
    (16, 2, 32, 1, [(1, 3), (9, 9), (4, 40)]),  # 1-token blocks
]


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size", "seqs"), SHAPES)
def test_native_attention_matches_the_torch_reference(heads, kv_heads, head_dim, block_size, seqs,  # noqa: ANN001
                                                      monkeypatch) -> None:  # noqa: ANN001
    batch = Batch(0, heads, kv_heads, head_dim, block_size, seqs)
    meta = batch.meta()
    assert kernels.attention_supported(batch.q, batch.k_cache), "the kernel did not build on a machine with gcc"
    native = batch.run(meta, batch.q, batch.k, batch.v)
    monkeypatch.setattr(attention.kernels, "attention_supported", lambda *_: False)
    reference = batch.run(meta, batch.q, batch.k, batch.v)
    torch.testing.assert_close(native, reference, rtol=2e-5, atol=2e-5)


def test_a_token_gets_bit_identical_attention_whatever_its_chunk_or_batch() -> None:
    batch = Batch(1, 9, 3, 64, 16, [(70, 70), (1, 33), (1, 129)])
    whole = batch.run(batch.meta(), batch.q, batch.k, batch.v)  # the 70-token prompt in one chunk
    prompt = slice(0, 70)
    chunked = []
    done = 0
    for size in (10, 1, 16, 43):  # the same prompt in chunks, each next to the two decodes
        seqs = [(size, done + size), (1, 33), (1, 129)]
        rows = torch.cat([torch.arange(done, done + size), torch.tensor([70, 71])])
        out = batch.run(batch.meta(seqs), batch.q[rows], batch.k[rows], batch.v[rows])
        chunked.append(out[:size])
        assert torch.equal(out[size:], whole[70:])  # the decodes are unchanged by their neighbour's chunking
        done += size
    assert torch.equal(torch.cat(chunked), whole[prompt])
    alone = Batch(1, 9, 3, 64, 16, [(70, 70), (1, 33), (1, 129)])  # same data, one sequence per call
    for i, rows in enumerate((slice(0, 70), slice(70, 71), slice(71, 72))):
        meta = alone.meta([alone.seqs[i]], alone.tables[i:i + 1])
        assert torch.equal(alone.run(meta, alone.q[rows], alone.k[rows], alone.v[rows]), whole[rows])


def test_unsupported_shapes_fall_back() -> None:
    query = torch.randn(2, 128, 64)
    k_cache, _ = allocate_kv_cache(4, 16, 1, 64, torch.float32, CPU)
    assert not kernels.attention_supported(query, k_cache)  # 128 query heads per kv head > 64
    k_cache, _ = allocate_kv_cache(4, 128, 8, 64, torch.float32, CPU)
    assert not kernels.attention_supported(torch.randn(2, 8, 64), k_cache)  # blocks of 128 tokens > 64
    k_cache, _ = allocate_kv_cache(4, 16, 8, 64, torch.float64, CPU)
    assert not kernels.attention_supported(torch.randn(2, 8, 64).double(), k_cache)
