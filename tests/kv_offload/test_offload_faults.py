"""Faults in the disk tier never change outputs or raise: corrupt, truncated and foreign chunk files (another
model's, another prefix's filed under this one's key, or one whose header names other token ids) are detected
and recomputed (and counted), a model
whose weights differ never reads another's chunks, a file that vanishes between lookup and load is a miss,
an unwritable path or a full disk turns the tier off, and a cap below one request's size is harmless."""
from __future__ import annotations

import errno
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch
from test_offload_engine import CHUNK_BYTES, _gen, engine, shared_prefix_prompts

from pressroom.kv_offload import tiers
from pressroom.kv_offload.layout import HEADER_BYTES, check_header

PROMPTS = shared_prefix_prompts(16, prefixes=4, prefix_len=96, seed=2)
CPU_GIB = 4 * CHUNK_BYTES / (1 << 30)  # 4 chunks: a prefix's 6 come back from disk
TOKENS_DIGEST = slice(4 + 2 + 16 + 16, 4 + 2 + 16 + 16 + 16)  # in the header: after magic, version, model, key


@pytest.fixture(scope="module")
def plain(tiny_model_dir) -> list[list[int]]:
    return _gen(engine(tiny_model_dir("llama")), PROMPTS)


def write_tier(model: str, path: Path) -> list[Path]:
    """Runs the prompts once with the disk tier at `path`; returns its chunk files."""
    llm = engine(model, kv_offloading_size=CPU_GIB, kv_offloading_disk_path=str(path))
    _gen(llm, PROMPTS)
    llm.shutdown()
    files = sorted(path.glob("*/*.kv"))
    assert files
    return files


def read_back(model: str, path: Path, **kw):
    llm = engine(model, kv_offloading_size=CPU_GIB, kv_offloading_disk_path=str(path), **kw)
    outputs = _gen(llm, PROMPTS)
    return outputs, llm.engine.stats().offload.tiers["1:fs"]


@pytest.mark.parametrize("damage", ["corrupt bytes", "truncated", "another model's", "another prefix's",
                                    "other token ids'"])
def test_bad_chunk_files_are_recomputed_and_counted(damage, plain, tiny_model_dir, tmp_path, caplog):
    model = tiny_model_dir("llama")
    files = write_tier(model, tmp_path)
    if damage == "another model's":
        other = write_tier(tiny_model_dir("qwen2"), tmp_path / "other")
        for f in files:  # the other model's chunk under this model's names
            f.write_bytes(other[0].read_bytes())
    if damage == "another prefix's":  # each file intact, under another chunk's name
        blobs = [f.read_bytes() for f in files]
        for f, blob in zip(files, blobs[1:] + blobs[:1]):
            f.write_bytes(blob)
    for f in files:
        data = bytearray(f.read_bytes())
        if damage == "corrupt bytes":
            data[len(data) // 2] ^= 0xFF
        elif damage == "truncated":
            data = data[:len(data) // 3]
        elif damage == "other token ids'":
            data[TOKENS_DIGEST] = bytes(b ^ 0xFF for b in data[TOKENS_DIGEST])
            payload = len(data) - HEADER_BYTES  # the model, the key, the length and the checksum still hold:
            check_header(bytes.fromhex(f.parent.name), f.stem, data, payload, payload)
        if damage in ("corrupt bytes", "truncated", "other token ids'"):
            f.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="pressroom"):
        outputs, fs = read_back(model, tmp_path)
    assert outputs == plain
    assert fs.corrupt_chunks > 0  # (hits may follow: the run stores the recomputed blocks again)
    assert sum("not served" in r.message for r in caplog.records) == 1  # warned once


def test_a_file_deleted_between_lookup_and_load_is_a_miss(plain, tiny_model_dir, tmp_path, monkeypatch):
    model = tiny_model_dir("llama")
    write_tier(model, tmp_path)
    read_into = tiers.FileTier.read_into  # how the engine reads the file tier (straight into a CPU slot)

    def vanishing(self, key, header, payload):
        (self.root / (key + self.suffix)).unlink(missing_ok=True)
        return read_into(self, key, header, payload)

    monkeypatch.setattr(tiers.FileTier, "read_into", vanishing)
    outputs, fs = read_back(model, tmp_path)
    assert outputs == plain
    assert fs.failed_jobs > 0


@pytest.mark.parametrize("where", ["/sys/pressroom-kv-offload", "under a file"])
def test_an_unwritable_path_turns_the_tier_off(where, plain, tiny_model_dir, tmp_path, caplog):
    if where == "under a file":
        (tmp_path / "file").write_text("")
        where = str(tmp_path / "file" / "kv")
    with caplog.at_level(logging.WARNING, logger="pressroom"):
        outputs, fs = read_back(tiny_model_dir("llama"), Path(where))
    assert outputs == plain
    assert fs.write_bytes == 0
    assert any("fs tier turned off" in r.message for r in caplog.records)


def test_a_full_disk_turns_the_tier_off(plain, tiny_model_dir, tmp_path, monkeypatch, caplog):
    def full(src, dst):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(tiers.os, "replace", full)
    with caplog.at_level(logging.WARNING, logger="pressroom"):
        outputs, fs = read_back(tiny_model_dir("llama"), tmp_path)
    assert outputs == plain
    assert fs.write_bytes == 0 and not list(tmp_path.glob("*/*.kv"))
    assert sum("fs tier turned off" in r.message for r in caplog.records) == 1


def test_a_disk_cap_below_one_request_keeps_outputs(plain, tiny_model_dir, tmp_path):
    model = tiny_model_dir("llama")
    cap = 2.5 * (CHUNK_BYTES + HEADER_BYTES)
    outputs, fs = read_back(model, tmp_path, kv_offloading_disk_size=cap / (1 << 30))
    assert outputs == plain
    held = sum(f.stat().st_size for f in tmp_path.glob("*/*.kv"))
    assert fs.write_bytes > held and held <= cap


def shuffled_weights(model: str, into: Path) -> Path:
    """A copy of the checkpoint at `into` whose weights differ (each matrix's values shuffled), as between two
    fine-tunes: same names, shapes, dtypes and file sizes."""
    from safetensors.torch import load_file, save_file
    shutil.copytree(model, into)
    gen = torch.Generator().manual_seed(11)
    for file in into.glob("*.safetensors"):
        weights = {name: t.flatten()[torch.randperm(t.numel(), generator=gen)].view(t.shape) if t.dim() > 1 else t
                   for name, t in load_file(file).items()}
        save_file(weights, file, metadata={"format": "pt"})
        assert file.stat().st_size == (Path(model) / file.name).stat().st_size
    return into


# Each prompt with a prefix of its own: a hit in the second run can only be a chunk the first run wrote.
DISTINCT = [shared_prefix_prompts(1, prefixes=1, prefix_len=96, seed=seed)[0] for seed in range(6)]


@pytest.mark.parametrize("where", ["another directory", "replaced in place"])
def test_a_model_whose_weights_differ_never_reads_anothers_chunks(where, tiny_model_dir, tmp_path):
    """Two checkpoints of one architecture and shapes whose weights differ share the disk path (or the first is
    overwritten in place by the second, same size, and the server restarts): the second computes its own KV."""
    first = Path(shutil.copytree(tiny_model_dir("llama"), tmp_path / "first"))
    second = shuffled_weights(tiny_model_dir("llama"), tmp_path / "second")
    own = _gen(engine(str(second)), DISTINCT)
    assert own != _gen(engine(str(first)), DISTINCT)  # the weights do matter
    disk, cpu_gib = tmp_path / "kv", 40 * CHUNK_BYTES / (1 << 30)  # room for every chunk: all reach the disk
    llm = engine(str(first), kv_offloading_size=cpu_gib, kv_offloading_disk_path=str(disk))
    _gen(llm, DISTINCT)
    llm.shutdown()
    assert len(list(disk.glob("*/*.kv"))) >= len(DISTINCT) * 96 // 16
    if where == "replaced in place":
        for file in first.glob("*.safetensors"):
            with open(file, "r+b") as f:  # same inode, same size
                f.write((second / file.name).read_bytes())
        second = first
    llm = engine(str(second), kv_offloading_size=cpu_gib, kv_offloading_disk_path=str(disk))
    assert _gen(llm, DISTINCT) == own
    fs = llm.engine.stats().offload.tiers["1:fs"]
    assert fs.chunk_hits == 0 and fs.corrupt_chunks == 0  # the first model's files are not even looked at
    assert len(list(disk.iterdir())) == 2  # one directory per fingerprint
