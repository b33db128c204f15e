"""The known KV bytes: what the stand-in forward writes into every token's K and V slots, and
the check a decode engine runs on KV it never computed.

A byte is a function of (token id, position, layer, K-or-V, byte index) only. It does not depend
on the request id, the engine, the TP size or the block a token sits in, so a decode engine can
recompute what a prefill engine wrote. The byte index counts over the whole layer's K (or V)
row of one token, all KV heads of the model together (head-major, `head * head_bytes + j`), so
a TP rank that holds heads 2..3 checks bytes 2*head_bytes.. of the same row a TP1 engine holds
whole.

A layer's cache, as vLLM 0.34 allocates it (`vllm.v1.worker.utils.allocate_kv_cache`), is a
`[blocks, kv_heads, block_size, (head_size + head_size_v) * dtype_size]` view: K is the first
`head_size * dtype_size` bytes of the last axis, V the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

K, V = 0, 1
MASK32 = 0xFFFFFFFF
# Odd multipliers below 2**31, so that a 32-bit value times one fits in a signed int64.
_M_TOKEN = 0x1E3779B1
_M_POS = 0x05EBCA77
_M_LAYER = 0x42B2AE3D
_M_BYTE = 0x27D4EB2F
_M_MIX1 = 0x2C1B3C6D
_M_MIX2 = 0x297A2D39


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche step (xorshift-multiply), kept in int64 so it never overflows."""
    x = x & MASK32
    x = x ^ (x >> 15)
    x = (x * _M_MIX1) & MASK32
    x = x ^ (x >> 12)
    x = (x * _M_MIX2) & MASK32
    x = x ^ (x >> 15)
    return x


def pattern(
    token_ids: torch.Tensor,
    positions: torch.Tensor,
    layer: int,
    kv: int,
    byte_index: torch.Tensor,
) -> torch.Tensor:
    """Bytes `[len(token_ids), len(byte_index)]` (uint8) for the given tokens of one layer."""
    tok = token_ids.to(torch.int64).reshape(-1, 1)
    pos = positions.to(torch.int64).reshape(-1, 1)
    idx = byte_index.to(torch.int64).reshape(1, -1)
    row = _mix((tok * _M_TOKEN) ^ _mix(pos * _M_POS + (2 * layer + kv + 1) * _M_LAYER))
    x = _mix(row + idx * _M_BYTE)
    return (x & 0xFF).to(torch.uint8)


@dataclass(frozen=True)
class Geometry:
    """Where one TP rank's share of a layer's KV row sits."""

    head_bytes: int
    """Bytes of one head's K (equal to V's: the harness models head_size_v == head_size)."""
    global_heads: tuple[int, ...]
    """The model-wide KV head index of each head slot this rank holds, in slot order."""

    @staticmethod
    def for_rank(
        total_kv_heads: int, tp_size: int, tp_rank: int, head_size: int, dtype_size: int
    ) -> Geometry:
        """vLLM's split: whole heads per rank, or each rank a replica when heads < ranks."""
        if total_kv_heads >= tp_size:
            per_rank = total_kv_heads // tp_size
            heads = tuple(range(tp_rank * per_rank, (tp_rank + 1) * per_rank))
        else:
            heads = (tp_rank * total_kv_heads // tp_size,)
        return Geometry(head_bytes=head_size * dtype_size, global_heads=heads)

    def byte_index(self) -> torch.Tensor:
        """`[heads, head_bytes]` model-wide byte indices of this rank's slots."""
        heads = torch.tensor(self.global_heads, dtype=torch.int64).reshape(-1, 1)
        return heads * self.head_bytes + torch.arange(self.head_bytes).reshape(1, -1)


def expected_slots(
    token_ids: torch.Tensor, positions: torch.Tensor, layer: int, geometry: Geometry
) -> torch.Tensor:
    """`[tokens, heads, 2 * head_bytes]` uint8: what each token's slot must hold (K then V)."""
    idx = geometry.byte_index()
    heads, head_bytes = idx.shape
    parts = []
    for kv in (K, V):
        flat = pattern(token_ids, positions, layer, kv, idx.reshape(-1))
        parts.append(flat.reshape(-1, heads, head_bytes))
    return torch.cat(parts, dim=2)


def as_bytes(kv_cache: torch.Tensor) -> torch.Tensor:
    """The `[blocks, heads, block_size, bytes]` uint8 view of a layer cache (no copy)."""
    return kv_cache.view(torch.uint8)


def write(
    kv_cache: torch.Tensor,
    slots: torch.Tensor,
    block_size: int,
    token_ids: torch.Tensor,
    positions: torch.Tensor,
    layer: int,
    geometry: Geometry,
) -> None:
    """Writes the known bytes of the given tokens into their slots of one layer."""
    if slots.numel() == 0:
        return
    cache = as_bytes(kv_cache)
    cache[slots // block_size, :, slots % block_size] = expected_slots(
        token_ids, positions, layer, geometry
    )


@dataclass
class Mismatch:
    """One wrong byte: which request, layer, position, K or V, and byte of the KV row."""

    request_id: str
    layer: int
    position: int
    kv: str
    byte_offset: int
    expected: int
    actual: int


@dataclass
class CheckResult:
    bytes_verified: int = 0
    mismatched_bytes: int = 0
    mismatches: list[Mismatch] = field(default_factory=list)


def merge(into: CheckResult, other: CheckResult, keep: int = 32) -> None:
    """Adds `other`'s counts to `into`, keeping at most `keep` recorded mismatches."""
    into.bytes_verified += other.bytes_verified
    into.mismatched_bytes += other.mismatched_bytes
    into.mismatches.extend(other.mismatches[: max(0, keep - len(into.mismatches))])


def check(
    kv_cache: torch.Tensor,
    slots: torch.Tensor,
    block_size: int,
    token_ids: torch.Tensor,
    positions: torch.Tensor,
    layer: int,
    geometry: Geometry,
    request_id: str,
    result: CheckResult,
    keep: int = 32,
) -> None:
    """Compares the slots of one request in one layer with the known bytes.

    Every byte counts towards `bytes_verified`; every wrong one towards `mismatched_bytes`, and
    the first `keep` of a run are recorded with their coordinates.
    """
    if slots.numel() == 0:
        return
    cache = as_bytes(kv_cache)
    actual = cache[slots // block_size, :, slots % block_size]
    expected = expected_slots(token_ids, positions, layer, geometry)
    result.bytes_verified += expected.numel()
    wrong = (actual != expected).nonzero()
    if wrong.numel() == 0:
        return
    result.mismatched_bytes += wrong.shape[0]
    for t, h, c in wrong[: max(0, keep - len(result.mismatches))].tolist():
        kv = "K" if c < geometry.head_bytes else "V"
        result.mismatches.append(
            Mismatch(
                request_id=request_id,
                layer=layer,
                position=int(positions[t]),
                kv=kv,
                byte_offset=geometry.global_heads[h] * geometry.head_bytes
                + c % geometry.head_bytes,
                expected=int(expected[t, h, c]),
                actual=int(actual[t, h, c]),
            )
        )
