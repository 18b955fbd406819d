"""Unit tests of layerwise/transfer/base.py and packed_tensor.py: info parsing, errors, the bucket layout."""

import random

import pytest
import torch

from layerwise.errors import ReloadError
from layerwise.transfer import (
    TensorListUpdateInfo,
    WeightTransferEngine,
    WeightTransferInitRequest,
    WeightTransferTimeoutError,
    WeightTransferUpdateInfo,
    WeightTransferUpdateRequest,
    tensor_metadata,
)
from layerwise.transfer.packed_tensor import ALIGN_BYTES, BucketLayout, flat_bytes, plan_buckets, unpack_bucket


class ListEngine(WeightTransferEngine):
    init_info_cls = WeightTransferInitRequest  # any dataclass with a defaulted field
    update_info_cls = TensorListUpdateInfo

    def init_transfer_engine(self, init_info):
        pass

    def receive_weights(self, update_info, load_weights):
        pass

    def shutdown(self):
        pass

    @staticmethod
    def trainer_send_weights(iterator, trainer_args):
        pass


def test_parse_update_info_names_unknown_and_missing_fields():
    engine = ListEngine()
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['extra', 'packd'\]; missing field\(s\) \['shapes'\]"):
        engine.parse_update_info({"names": [], "dtype_names": [], "packd": True, "extra": 1})
    with pytest.raises(ValueError, match="must be a dict"):
        engine.parse_update_info([("names", [])])
    with pytest.raises(ValueError, match="is_checkpoint_format must be a bool"):
        engine.parse_update_info({"names": [], "dtype_names": [], "shapes": [], "is_checkpoint_format": "yes"})
    with pytest.raises(ValueError, match="'w'.*non-negative"):
        engine.parse_update_info({"names": ["w"], "dtype_names": ["float32"], "shapes": [[2, -1]]})
    info = engine.parse_update_info({"names": ["w"], "dtype_names": ["torch.float8_e4m3fn"], "shapes": [[2, 3]]})
    assert info.is_checkpoint_format and info.dtypes == [torch.float8_e4m3fn] and info.nbytes(0) == 6
    assert engine.parse_update_info(info) is info
    assert engine.parse_init_info({"init_info": {"a": 1}}).init_info == {"a": 1}


def test_dataclasses_and_requests():
    assert WeightTransferUpdateInfo().is_checkpoint_format is True
    assert WeightTransferUpdateRequest().update_info == {} and WeightTransferInitRequest().init_info == {}
    meta = tensor_metadata([("a", torch.zeros(2, 3, dtype=torch.bfloat16)), ("b", torch.tensor(1.0))])
    assert meta == {"names": ["a", "b"], "dtype_names": ["bfloat16", "float32"], "shapes": [[2, 3], []]}


def test_timeout_error_is_a_reload_error_and_a_timeout():
    e = WeightTransferTimeoutError("no data", updated_modules=["m"], key="w")
    assert isinstance(e, ReloadError) and isinstance(e, TimeoutError)
    assert e.updated_modules == ["m"] and "'w'" in str(e)


def test_layout_keeps_buckets_within_capacity_and_oversize_tensors_alone():
    buckets = plan_buckets([10, 20, 5000, 7, 3, 40], capacity=64)
    assert [[i for i, _, _ in b.entries] for b in buckets] == [[0, 1], [2], [3, 4], [5]]
    assert buckets[0].entries == [(0, 0, 10), (1, 16, 20)] and buckets[0].nbytes == 36
    assert buckets[1].nbytes == 5000
    assert [len(b.entries) for b in plan_buckets([1, 2, 3], capacity=None)] == [1, 1, 1]


def test_layout_sender_and_receiver_agree():
    rng = random.Random(0)
    for _ in range(50):
        sizes = [rng.choice([0, 1, 2, 15, 16, 17, 100, 300]) for _ in range(rng.randint(1, 30))]
        capacity = rng.choice([None, 16, 64, 256])
        planned = plan_buckets(sizes, capacity)
        layout, streamed = BucketLayout(capacity), []
        for i, n in enumerate(sizes):
            closed = layout.place(i, n)
            if closed:
                streamed.append(closed)
        streamed.append(layout.close())
        assert planned == streamed
        assert [i for b in planned for i, _, _ in b.entries] == list(range(len(sizes)))
        for b in planned:
            assert all(off % ALIGN_BYTES == 0 for _, off, _ in b.entries)
            assert capacity is None or b.nbytes <= capacity or len(b.entries) == 1
            ends = [off + n for _, off, n in b.entries]
            assert all(e <= off for e, (_, off, _) in zip(ends[:-1], b.entries[1:], strict=True))  # no overlap


def test_pack_then_unpack_round_trips_mixed_dtypes():
    tensors = [
        ("bf16", torch.randn(3, 5).bfloat16()),
        ("fp8", torch.randn(4, 4).to(torch.float8_e4m3fn)),
        ("f32", torch.randn(7)),
        ("scalar", torch.tensor(2.5)),
        ("empty", torch.zeros(0, 3)),
    ]
    meta = tensor_metadata(tensors)
    info = TensorListUpdateInfo(**meta)
    (bucket,) = plan_buckets([info.nbytes(i) for i in range(len(tensors))], capacity=1024)
    buffer = torch.zeros(bucket.nbytes, dtype=torch.uint8)
    for (_, off, n), (_, t) in zip(bucket.entries, tensors, strict=True):
        buffer[off : off + n].copy_(flat_bytes(t))
    unpacked = unpack_bucket(buffer, bucket, info.names, info.dtypes, info.shapes)
    for (name, got), (_, want) in zip(unpacked, tensors, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert torch.equal(flat_bytes(got), flat_bytes(want)), name
