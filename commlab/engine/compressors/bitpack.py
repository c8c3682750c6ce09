"""Bit packing for sign, ternary and 4-bit payloads.

Layout: element 0 sits in the most significant bits of byte 0 (numpy's
``packbits`` order); the last byte is zero padded.

The packers work on machine words rather than on bytes (SWAR): eight bool
bytes viewed as one int64 are gathered into one byte by a single multiply,
because every partial product lands on its own bit and nothing carries. On
one thread that is ~4x faster than the textbook ``view(-1, 8) * weights ->
sum`` (25M bits: 12 ms against 52 ms, shift-and-sum 73 ms). Unpacking runs
the multiply backwards: copy the byte into all eight lanes, keep one bit per
lane, and turn "some bit set" into 0/1 with an add that cannot carry across
lanes. Everything is elementwise torch, so it runs wherever the input lives.

The word tricks rely on two's complement wrap-around of int32/int64 products
(what every torch backend does) and on a little-endian byte order; a
big-endian host takes the plain multiply-sum path.
"""
from __future__ import annotations

import sys

import torch

Tensor = torch.Tensor

_LITTLE = sys.byteorder == "little"
WORDS = _LITTLE
"""True where ``pack_words`` works: bool bytes viewed as int64 words hold element i in byte i."""


def _s64(u: int) -> int:
    """An unsigned 64-bit constant as the int64 torch needs."""
    return u - (1 << 64) if u >= 1 << 63 else u


# 8 lanes of one byte each: lane i (byte i of the word) holds element i.
_GATHER8 = _s64(0x8040201008040201)  # sum of 2**(9j): lane 7-j's bit ends at bit 56+j
_SPREAD8 = 0x0101010101010101        # copies a byte into every lane
_PICK8 = 0x0102040810204080          # lane i keeps bit 7-i of the copied byte
_CARRY8 = 0x7F7F7F7F7F7F7F7F         # a kept bit (>= 1) pushes its lane to >= 0x80
# 4 lanes of one byte each, values 0..3.
_GATHER4 = 0x40100401                # sum of 2**(10j): lane 3-j's value ends at bits 24+2j
_LOW2 = 0x03030303

# The same as 0-d tensors: an operator costs ~1 µs less with one than with a Python number, which
# torch wraps into a tensor on every call (they combine with tensors on any device, as numbers do).
_GATHER8_T = torch.tensor(_GATHER8)
_56_T = torch.tensor(56)
_GATHER4_T = torch.tensor(_GATHER4)
_24_T = torch.tensor(24)

_WEIGHTS8 = (128, 64, 32, 16, 8, 4, 2, 1)
_WEIGHTS4 = (64, 16, 4, 1)


def packed_size(n: int, per_byte: int = 8) -> int:
    return -(-n // per_byte)


def _lanes(values: Tensor, per_word: int) -> Tensor:
    """Flat uint8 bytes of ``values``, zero padded to whole words and word aligned."""
    u = values.reshape(-1).view(torch.uint8)
    n = u.numel()
    m = packed_size(n, per_word) * per_word
    if n == m and u.storage_offset() % per_word == 0:
        return u
    padded = torch.zeros(m, dtype=torch.uint8, device=u.device)
    padded[:n] = u
    return padded


def pack_bits(bits: Tensor) -> Tensor:
    """Pack a bool tensor (any shape, read flat) into ``ceil(n/8)`` uint8 bytes."""
    if bits.dtype != torch.bool:
        raise TypeError(f"pack_bits: expected a bool tensor, got {bits.dtype}")
    u = _lanes(bits, 8)
    if not _LITTLE:
        w = torch.tensor(_WEIGHTS8, dtype=torch.uint8, device=u.device)
        return (u.view(-1, 8) * w).sum(1, dtype=torch.uint8)
    return pack_words(u.view(torch.int64))


def pack_words(words: Tensor) -> Tensor:
    """``pack_bits`` of bools already viewed as int64 words (8 per word; little-endian hosts, ``WORDS``).

    Callers that pack the same-sized buffer every step keep this view and skip the per-call checks.
    """
    # int64 -> uint8 keeps the low byte, so the sign the shift smears in is dropped
    w = words * _GATHER8_T
    w >>= _56_T
    return w.byte()


def bit_lanes(packed: Tensor, n: int) -> Tensor:
    """int64 words whose bytes are the 0/1 bits of the first ``n`` packed bits.

    Words of different payloads can be added directly: each byte counts up to
    255 without spilling into its neighbour (the majority vote uses this).
    Covers ``ceil(n/8)`` words; bytes past ``n`` are the padding bits.
    """
    m = packed_size(n)
    p = packed.reshape(-1)
    if p.numel() < m:
        raise ValueError(f"unpack: {p.numel()} bytes hold fewer than {n} bits")
    if not _LITTLE:
        w = torch.tensor(_WEIGHTS8, dtype=torch.uint8, device=p.device)
        return ((p[:m, None] & w) != 0).view(torch.uint8).reshape(-1).view(torch.int64)
    w = p[:m].to(torch.int64) * _SPREAD8
    w &= _PICK8
    w += _CARRY8
    w >>= 7
    w &= _SPREAD8
    return w


def unpack_bits(packed: Tensor, n: int) -> Tensor:
    """Inverse of ``pack_bits``: a bool tensor of the first ``n`` bits."""
    return bit_lanes(packed, n).view(torch.uint8)[:n].view(torch.bool)


def pack_2bit(values: Tensor) -> Tensor:
    """Pack uint8 values in 0..3 (any shape, read flat) four per byte, into ``ceil(n/4)`` bytes.

    Values above 3 are not checked: their high bits spill into the neighbour's slot.
    """
    if values.dtype != torch.uint8:
        raise TypeError(f"pack_2bit: expected a uint8 tensor, got {values.dtype}")
    u = _lanes(values, 4)
    if not _LITTLE:
        w = torch.tensor(_WEIGHTS4, dtype=torch.uint8, device=u.device)
        return (u.view(-1, 4) * w).sum(1, dtype=torch.uint8)
    w = u.view(torch.int32) * _GATHER4_T
    w >>= _24_T
    return w.byte()


def unpack_2bit(packed: Tensor, n: int) -> Tensor:
    """Inverse of ``pack_2bit``: a uint8 tensor of the first ``n`` values."""
    m = packed_size(n, 4)
    p = packed.reshape(-1)
    if p.numel() < m:
        raise ValueError(f"unpack_2bit: {p.numel()} bytes hold fewer than {n} values")
    if not _LITTLE:
        shifts = torch.tensor((6, 4, 2, 0), dtype=torch.uint8, device=p.device)
        return ((p[:m, None] >> shifts) & 3).reshape(-1)[:n]
    # byte y times sum of 2**(10i) puts y's i-th pair at the top of lane i; no two copies overlap
    w = p[:m].to(torch.int32) * _GATHER4
    w >>= 6
    w &= _LOW2
    return w.view(torch.uint8)[:n]


def pack_4bit(values: Tensor) -> Tensor:
    """Pack uint8 values in 0..15 (any shape, read flat) two per byte, element 0 in the high nibble, into
    ``ceil(n/2)`` bytes (the last low nibble zero when n is odd). Values above 15 are not checked."""
    if values.dtype != torch.uint8:
        raise TypeError(f"pack_4bit: expected a uint8 tensor, got {values.dtype}")
    u = _lanes(values, 2).view(-1, 2)
    return (u[:, 0] << 4) | u[:, 1]


def unpack_4bit(packed: Tensor, n: int) -> Tensor:
    """Inverse of ``pack_4bit``: a uint8 tensor of the first ``n`` values."""
    m = packed_size(n, 2)
    p = packed.reshape(-1)
    if p.numel() < m:
        raise ValueError(f"unpack_4bit: {p.numel()} bytes hold fewer than {n} values")
    p = p[:m]
    return torch.stack((p >> 4, p & 15), dim=1).reshape(-1)[:n]
