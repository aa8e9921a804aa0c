"""The model fingerprint the disk tier files chunks under: it follows the weights' content (not their names or
sizes), hashed once per file identity and then read from the hash cache, and everything else that determines
KV; a checkpoint copied elsewhere keeps it (the cache stays valid), dummy weights are never read."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from pressroom.config import ModelConfig
from pressroom.kv_offload import layout

SHAPE = (2, 2, 2, 16, 8)


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"rope_theta": 10000, "hidden_size": 64}')
    (model / "tokenizer_config.json").write_text('{"chat_template": "a"}')
    for i in range(2):
        (model / f"model-0000{i}.safetensors").write_bytes(os.urandom(1 << 16))
    return model


def fingerprint(path: Path, cache: Path, **model) -> bytes:
    config = ModelConfig(model=str(path), **{"dtype": torch.float32, **model})
    return layout.model_fingerprint(str(path), config, torch.float32, 16, SHAPE, hash_cache=cache)


@pytest.fixture
def settled(monkeypatch):
    """The checkpoint's files count as settled though just written (hashes are cached only for files that
    changed more than a second before they were looked at)."""
    monkeypatch.setattr(layout, "_SETTLE_NS", -1)


def test_weights_are_hashed_once_per_file_identity(checkpoint, tmp_path, monkeypatch, settled):
    cache = tmp_path / "hashes"
    first = fingerprint(checkpoint, cache)
    assert len(list(cache.iterdir())) == 2  # one entry per weight file

    def no_reads(path):
        raise AssertionError(f"{path} hashed again")

    monkeypatch.setattr(layout, "_hash_file", no_reads)
    assert fingerprint(checkpoint, cache) == first


def test_a_weight_file_rewritten_in_place_with_the_same_size_changes_it(checkpoint, tmp_path, settled):
    cache = tmp_path / "hashes"
    first = fingerprint(checkpoint, cache)
    assert len(list(cache.iterdir())) == 2
    weights = checkpoint / "model-00001.safetensors"
    stat = weights.stat()
    time.sleep(0.05)  # past the file system clock's tick: the change time moves
    with open(weights, "r+b") as f:  # same inode, same size, and the modification time put back
        f.seek(1000)
        f.write(b"\x01\x02\x03")
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert fingerprint(checkpoint, cache) != first


def test_what_determines_kv_changes_it_and_nothing_else_does(checkpoint, tmp_path):
    cache = tmp_path / "hashes"
    base = fingerprint(checkpoint, cache)
    (checkpoint / "tokenizer_config.json").write_text('{"chat_template": "b"}')
    assert fingerprint(checkpoint, cache) == base  # the tokenizer does not change KV
    assert fingerprint(checkpoint, cache, quantization="none") != base
    assert fingerprint(checkpoint, cache, dtype=torch.bfloat16) != base
    assert layout.model_fingerprint(str(checkpoint), ModelConfig(model=str(checkpoint), dtype=torch.float32),
                                    torch.float16, 16, SHAPE, hash_cache=cache) != base  # the KV dtype
    (checkpoint / "config.json").write_text('{"rope_theta": 500000, "hidden_size": 64}')
    assert fingerprint(checkpoint, cache) != base


def test_a_copied_checkpoint_keeps_its_fingerprint(checkpoint, tmp_path):
    import shutil
    copy = Path(shutil.copytree(checkpoint, tmp_path / "elsewhere"))
    assert fingerprint(copy, tmp_path / "hashes") == fingerprint(checkpoint, tmp_path / "hashes")


def test_dummy_weights_are_named_by_their_seed_and_never_read(checkpoint, tmp_path, monkeypatch):
    monkeypatch.setattr(layout, "_hash_file", lambda path: pytest.fail(f"{path} read"))
    cache = tmp_path / "hashes"
    one = fingerprint(checkpoint, cache, load_format="dummy", seed=1)
    assert one == fingerprint(checkpoint, cache, load_format="dummy", seed=1)
    assert one != fingerprint(checkpoint, cache, load_format="dummy", seed=2)


def test_a_file_changed_just_now_is_not_cached(checkpoint, tmp_path):
    """A second change within the file system clock's tick would leave the file's identity as it was."""
    fingerprint(checkpoint, tmp_path / "hashes")
    assert not list((tmp_path / "hashes").glob("*"))


def test_an_unwritable_hash_cache_only_costs_a_second_hash(checkpoint, tmp_path, settled):
    (tmp_path / "file").write_text("")
    assert fingerprint(checkpoint, tmp_path / "file" / "hashes") == fingerprint(checkpoint, tmp_path / "hashes")
