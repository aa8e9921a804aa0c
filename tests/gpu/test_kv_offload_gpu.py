"""KV offload on CUDA: 1,000 shared-prefix requests through the pinned CPU tier and the disk tier give the
greedy fp32 outputs of a run without offload, with blocks really moving both ways."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the H200 machine)")]

sys.path.insert(0, str(Path(__file__).parents[1] / "kv_offload"))
from test_offload_engine import CHUNK_BYTES, _gen, shared_prefix_prompts  # noqa: E402

from pressroom import LLM  # noqa: E402


def cuda_engine(model: str, **kw) -> LLM:
    return LLM(model, dtype="float32", skip_tokenizer_init=True, num_gpu_blocks_override=24, max_num_seqs=2,
               device="cuda", **kw)


def tiny_llama(path: Path) -> str:
    """The tiny llama without a tokenizer (the GPU machine has no embedded GGUF to take one from)."""
    import transformers
    from conftest import TINY_SHAPE
    torch.manual_seed(1234)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_SHAPE)).save_pretrained(path)
    return str(path)


def test_1000_requests_through_pinned_cpu_and_disk_tiers_equal_no_offload(tmp_path):
    model = tiny_llama(tmp_path / "model")
    prompts = shared_prefix_prompts(1000, prefixes=12, prefix_len=96, seed=1)
    plain = _gen(cuda_engine(model), prompts)
    llm = cuda_engine(model, kv_offloading_size=20 * CHUNK_BYTES / (1 << 30),
                      kv_offloading_disk_path=str(tmp_path / "kv"))
    assert _gen(llm, prompts) == plain
    stats = llm.engine.stats().offload
    assert stats.tiers["0:cpu"].chunk_hits > 0 and stats.tiers["1:fs"].chunk_hits > 0
    assert stats.total_bytes["device_to_cpu"] > 0 and stats.total_bytes["cpu_to_device"] > 0


def test_chunks_the_cpu_backend_wrote_serve_the_cuda_engine(tmp_path):
    """The on-tier layout is the backend's neither: a disk tier the CPU engine filled serves a CUDA engine's
    prefixes (same weights, dtype and block size), and its outputs stay those of CUDA without offload."""
    model = tiny_llama(tmp_path / "model")
    prompts = shared_prefix_prompts(60, prefixes=6, prefix_len=96, seed=2)
    disk = str(tmp_path / "kv")
    offload = {"kv_offloading_size": 8 * CHUNK_BYTES / (1 << 30), "kv_offloading_disk_path": disk}
    writer = LLM(model, dtype="float32", skip_tokenizer_init=True, num_gpu_blocks_override=24, max_num_seqs=2,
                 device="cpu", **offload)
    _gen(writer, prompts)
    writer.shutdown()
    plain = _gen(cuda_engine(model), prompts)
    reader = cuda_engine(model, **offload)
    assert _gen(reader, prompts) == plain
    assert reader.engine.stats().offload.tiers["1:fs"].chunk_hits > 0


def test_ranks_in_worker_processes_copy_through_their_page_locked_mapping(tmp_path):
    """The CPU tier is the engine core's shared memory; a worker process maps and page-locks it (the
    in-process worker's mapping is checked for page-locking, the worker process for outputs)."""
    model = tiny_llama(tmp_path / "model")
    prompts = shared_prefix_prompts(300, prefixes=12, prefix_len=96, seed=4)
    plain = _gen(cuda_engine(model), prompts)
    offload = {"kv_offloading_size": 20 * CHUNK_BYTES / (1 << 30)}
    inproc = cuda_engine(model, **offload)
    assert inproc.engine.core.executor.driver_worker.model_runner.kv_offload.slab.is_pinned()
    inproc.shutdown()
    llm = cuda_engine(model, distributed_executor_backend="mp", **offload)
    assert _gen(llm, prompts) == plain
    assert llm.engine.stats().offload.tiers["0:cpu"].chunk_hits > 0
    llm.shutdown()
