"""The wire agreement's pure parts: the checksums (CPU: zlib's CRC-32; the CUDA one, Fletcher, run here on the CPU
against a plain-Python Fletcher), and the header digest."""

import pytest
import torch

from layerwise.transfer import wire


def _reference(data: bytes) -> list[int]:
    """Fletcher over little-endian 16-bit words, position weights (i mod 65521) + 1, modulo 2^31 - 1."""
    if len(data) % 2:
        data += b"\0"
    s1 = s2 = 0
    for i in range(0, len(data), 2):
        w = data[i] | data[i + 1] << 8
        s1 = (s1 + w) % (2**31 - 1)
        s2 = (s2 + w * ((i // 2) % 65521 + 1)) % (2**31 - 1)
    return [s1, s2]


@pytest.mark.parametrize("n", [0, 1, 7, 4096, 65521 * 2 + 10])
def test_checksum_equals_the_reference(n):
    data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    assert wire.fletcher(data) == _reference(bytes(data.tolist()))


def test_checksum_of_a_view_at_an_odd_offset_and_across_chunks(monkeypatch):
    data = torch.randint(0, 256, (10_001,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    assert wire.fletcher(data[1:]) == _reference(bytes(data[1:].tolist()))
    monkeypatch.setattr(wire, "_CHUNK_WORDS", wire._WEIGHT_PERIOD)  # several chunks: the weights carry over
    data = torch.randint(0, 256, (3 * 2 * wire._WEIGHT_PERIOD + 7,), dtype=torch.uint8)
    assert wire.fletcher(data) == _reference(bytes(data.tolist()))


def test_checksum_sees_a_flipped_bit_two_swapped_words_and_zeroed_bytes():
    data = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    base = wire.fletcher(data)
    flipped = data.clone()
    flipped[100] ^= 1
    swapped = data.clone()
    swapped[10:12], swapped[20:22] = data[20:22].clone(), data[10:12].clone()
    zeroed = data.clone()
    zeroed[-64:] = 0
    for other in (flipped, swapped, zeroed):
        assert wire.fletcher(other) != base


def test_header_digest_covers_names_dtypes_shapes_order_and_settings():
    a = [("x", "bfloat16", [2, 3]), ("y", "float32", [4])]
    base = wire.header(a, 28, False, 2)
    assert base[:2] == [28, 2] and wire.header(a, 28, False, 2) == base
    assert wire.header(a[::-1], 28, False, 2) != base
    assert wire.header([("x", "float16", [2, 3]), a[1]], 28, False, 2) != base
    assert wire.header([("x", "bfloat16", [3, 2]), a[1]], 28, False, 2) != base
    assert wire.header(a, 28, True, 2) != base and wire.header(a, 28, False, 3) != base  # verify, slots
    assert wire.header([], 0, False, 2)[0] == wire.END and wire.abort_header()[0] == wire.ABORT
