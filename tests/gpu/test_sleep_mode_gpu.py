"""Sleep mode on CUDA (vLLM's --enable-sleep-mode, worker/sleep.py): a tiny llama with CUDA graphs; level 1 moves
the weights to pinned host memory and frees the KV cache, level 2 frees both; the device then holds about the
weights' and the cache's bytes less (torch's allocator and the driver's free memory agree), and after wake_up the
graphs are captured again and the greedy tokens are those before sleeping."""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the H200 machine)")]

from pressroom import LLM, SamplingParams  # noqa: E402

LAYERS, HIDDEN, INTERMEDIATE, HEADS, KV_HEADS = 8, 1024, 4096, 16, 8
PROMPTS = [[5, 17, 300, 42, 9, 77, 128, 3, 250, 61], [900, 2, 44, 1000, 7], list(range(100, 160))]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
KV_GIB = 0.5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    """A tiny llama without a tokenizer, its weights ~0.5 GiB in fp32 so the memory figures stand out."""
    import transformers
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=2048, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                                      num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                      num_key_value_heads=KV_HEADS, initializer_range=0.05, tie_word_embeddings=False)
    path = str(tmp_path_factory.mktemp("sleep-llama-gpu"))
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def _tokens(llm: LLM) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _weight_bytes(worker) -> int:
    return sum(p.numel() * p.element_size() for p in worker.model.parameters())


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_device_memory_and_wakes_to_the_same_tokens(checkpoint, level):
    llm = LLM(checkpoint, dtype="float32", skip_tokenizer_init=True, device="cuda", kv_cache_memory_gib=KV_GIB,
              max_num_seqs=4, enable_sleep_mode=True)
    try:
        worker = llm.engine.core.executor.driver_worker
        assert llm.engine.core.cuda_graphs and worker.model_runner.graphs is not None
        before = _tokens(llm)
        expected = _weight_bytes(worker) + int(KV_GIB * 2**30)
        torch.cuda.synchronize()
        allocated, free = torch.cuda.memory_allocated(), torch.cuda.mem_get_info()[0]

        llm.sleep(level=level)
        assert llm.is_sleeping()
        assert allocated - torch.cuda.memory_allocated() >= 0.95 * expected
        assert torch.cuda.mem_get_info()[0] - free >= 0.9 * expected  # given back to the driver (empty_cache)

        llm.wake_up(tags=["weights"])
        assert llm.is_sleeping() and worker.model_runner.kv_caches == []
        llm.wake_up(tags=["kv_cache"])
        assert not llm.is_sleeping() and worker.model_runner.graphs is not None  # captured again
        assert _tokens(llm) == before
    finally:
        llm.shutdown()
