"""Each backend's metadata builder: its index dtypes, and (Triton) split-KV counts from the device's own SM
count, split as the decode graph of the padded size is."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pressroom.attention.torch_ref import TorchAttentionBackend


def _build(builder, num_decodes: int, lens: list[int]):
    loc = list(range(len(lens) + 1))
    return builder.build(num_decodes=num_decodes, slot_mapping=torch.zeros(len(lens), dtype=torch.int64),
                         block_tables=torch.zeros(len(lens), 4, dtype=builder.index_dtype),
                         seq_lens=torch.tensor(lens, dtype=builder.index_dtype), query_start_loc=loc,
                         seq_lens_host=lens, max_query_len=1)


def test_torch_builder_keeps_cpu_layout():
    builder = TorchAttentionBackend().make_metadata_builder("cpu", num_kv_heads=2, max_blocks_per_seq=64)
    assert builder.index_dtype == torch.int64
    meta = _build(builder, 3, [5, 6, 7])
    assert meta.num_decodes == meta.num_decode_tokens == 3
    assert meta.num_kv_splits == 1 and meta.query_start_loc_device is None
    assert meta.query_start_loc == [0, 1, 2, 3] and meta.seq_lens_host == [5, 6, 7]


triton_backend = pytest.importorskip("pressroom.attention.triton_backend",
                                     reason="triton is not installed: no CUDA backend to build for")


def test_triton_builder_without_cuda_uses_the_default_sm_count():
    builder = triton_backend.TritonAttentionBackend().make_metadata_builder("cpu", 8, 1024)
    assert builder.index_dtype == torch.int32
    assert builder.target_programs == 2 * triton_backend._DEFAULT_SMS
    meta = _build(builder, 2, [100, 200])
    assert meta.query_start_loc_device.dtype == torch.int32
    assert meta.query_start_loc_device.tolist() == [0, 1, 2]
    assert meta.num_kv_splits == triton_backend.num_kv_splits(2, 8, 1024)


@pytest.mark.parametrize("sms", [16, 132, 264])
def test_triton_builder_splits_by_the_devices_sm_count(monkeypatch, sms):
    calls = []

    def properties(device):
        calls.append(device)
        return SimpleNamespace(multi_processor_count=sms)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    builder = triton_backend.TritonMetadataBuilder("cuda", num_kv_heads=1, max_blocks_per_seq=4096)
    assert len(calls) == 1  # read once, at construction
    assert builder.target_programs == 2 * sms
    for n in (1, 2, 3, 8, 64):
        assert builder.num_kv_splits(n) == max(1, min(-(-2 * sms // n), triton_backend._MAX_SPLITS))
    builder.num_kv_splits(5)
    assert len(calls) == 1
    assert builder.num_kv_splits(0) == 1


def test_triton_builder_splits_as_the_padded_graph():
    builder = triton_backend.TritonAttentionBackend().make_metadata_builder("cpu", 2, 4096)
    eager = [builder.num_kv_splits(n) for n in range(1, 20)]
    builder.split_as_graphs([1, 2, 4, 8, 16])
    for n in range(1, 17):
        padded = next(s for s in (1, 2, 4, 8, 16) if s >= n)
        assert builder.num_kv_splits(n) == eager[padded - 1]
    assert builder.num_kv_splits(17) == eager[16]  # larger than every graph: runs eager, split by itself
