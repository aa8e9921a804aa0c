"""Weight offloading on CUDA (--cpu-offload-gb, model/weight_offload.py): a tiny llama in fp32 and bf16 gives the
greedy tokens of the same model without offload, with CUDA graphs captured and replayed (the copies from pinned
host memory into the fixed staging slots are graph nodes: corrupting a host copy after capture changes the output,
restoring it brings the tokens back); the device holds about the offloaded bytes less, loading never put them
there, and the memory profile sees only the resident weights and the staging slots."""
from __future__ import annotations

import gc
import logging
import re

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the H200 machine)")]

from pressroom import LLM, SamplingParams  # noqa: E402
from pressroom.config import ModelConfig  # noqa: E402
from pressroom.model.loader import load_model  # noqa: E402

LAYERS, HIDDEN, INTERMEDIATE, HEADS, KV_HEADS = 8, 1024, 4096, 16, 8
PROMPTS = [[5, 17, 300, 42, 9, 77, 128, 3, 250, 61], [900, 2, 44, 1000, 7], list(range(100, 160))]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    """A tiny llama without a tokenizer (the GPU machine has no embedded GGUF to take one from), its layers some
    tens of MiB so the memory figures stand out of the noise."""
    import transformers
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=2048, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                                      num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                      num_key_value_heads=KV_HEADS, initializer_range=0.05, tie_word_embeddings=False)
    path = str(tmp_path_factory.mktemp("offload-llama-gpu"))
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def layer_gib(dtype: torch.dtype) -> float:
    kv = HIDDEN * HIDDEN // HEADS * KV_HEADS
    params = 2 * HIDDEN * HIDDEN + 2 * kv + 3 * HIDDEN * INTERMEDIATE + 2 * HIDDEN  # q, o, k, v, the MLP, two norms
    return params * dtype.itemsize / 2**30


def engine(path: str, dtype: str, **kw) -> LLM:
    return LLM(path, dtype=dtype, skip_tokenizer_init=True, device="cuda", gpu_memory_utilization=0.2,
               max_num_seqs=4, **kw)


def greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def worker(llm: LLM):
    return llm.engine.core.executor.driver_worker


def profiled_peak_gib(text: str) -> float:
    """The last memory profile's "weights + activation peak" (worker.determine_available_memory's log line)."""
    return float(re.findall(r"weights \+ activation peak ([0-9.]+) GiB", text)[-1])


def start(path: str, dtype: str, **kw) -> tuple[LLM, float]:
    """An engine and the device memory allocated before it (what an earlier engine left counts in its profile)."""
    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated() / 2**30
    return engine(path, dtype, **kw), before


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_tokens_equal_without_offload_with_cuda_graphs(checkpoint, dtype, caplog):
    torch_dtype = getattr(torch, dtype)
    with caplog.at_level(logging.INFO, logger="pressroom"):
        plain_llm, before = start(checkpoint, dtype)
        plain_peak = profiled_peak_gib(caplog.text) - before
        plain = greedy(plain_llm)
        plain_llm.shutdown()
        # 6 of 8 layers; no prefix caching: a run with a corrupted layer must not leave KV for the next run
        llm, before = start(checkpoint, dtype, cpu_offload_gb=5.5 * layer_gib(torch_dtype), enable_prefix_caching=False)
        offload_peak = profiled_peak_gib(caplog.text) - before
    w = worker(llm)
    offload = w.weight_offload
    assert offload is not None and len(offload.plan.layers) == 6
    assert all(h.is_pinned() for h in offload.hosts)
    # the profile counts the resident weights and the two slots: 6 layers out, 2 in
    saved_gib = (offload.host_bytes - offload.staging_bytes) / 2**30
    assert abs((plain_peak - offload_peak) - saved_gib) <= 0.02, (plain_peak, offload_peak, saved_gib)
    assert w.model_runner.graphs is not None and w.model_runner.graphs.graphs, "CUDA graphs were not captured"
    assert greedy(llm) == plain
    # the graphs replay the copies from the host buffers: a corrupted copy changes the tokens, restored it does not
    saved = offload.hosts[2].clone()
    offload.hosts[2].zero_()
    assert greedy(llm) != plain
    offload.hosts[2].copy_(saved)
    assert greedy(llm) == plain
    llm.shutdown()


def test_eager_offload_equals_graphs_offload(checkpoint):
    gib = 7.5 * layer_gib(torch.float32)  # every layer
    with_graphs = engine(checkpoint, "float32", cpu_offload_gb=gib)
    assert len(worker(with_graphs).weight_offload.plan.layers) == LAYERS
    tokens = greedy(with_graphs)
    with_graphs.shutdown()
    eager = engine(checkpoint, "float32", cpu_offload_gb=gib, enforce_eager=True)
    assert worker(eager).model_runner.graphs is None
    assert greedy(eager) == tokens
    eager.shutdown()


def _load(path: str, gib: float):
    """The loaded model, the device bytes it holds, and the most loading held on top of them."""
    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loaded = load_model(ModelConfig(model=path, dtype=torch.bfloat16, cpu_offload_gb=gib), "cuda")
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    return loaded, held, torch.cuda.max_memory_allocated() - before - held


def test_the_device_holds_the_offloaded_bytes_less_and_loading_never_put_them_there(checkpoint):
    plain, plain_bytes, _ = _load(checkpoint, 0)
    del plain
    loaded, offload_bytes, transient = _load(checkpoint, 5.5 * layer_gib(torch.bfloat16))
    offload = loaded.weight_offload
    assert len(offload.plan.layers) == 6
    saved = offload.host_bytes - offload.staging_bytes
    assert abs((plain_bytes - offload_bytes) - saved) < (1 << 20), (plain_bytes, offload_bytes, saved)
    assert transient < offload.host_bytes / 6, transient  # less than one offloaded layer ever passed through
