"""Tensor parallelism over NCCL on two GPUs: greedy tokens of TP 2 equal those of TP 1 on the same kind of GPU,
with CUDA graphs on (tiny random models in fp32, and the embedded SmolLM2 with its uneven head split). The CPU
form (gloo) is tests/distributed/test_tensor_parallel.py; this is the two-GPU issue's check."""
from __future__ import annotations

import os

import pytest
import torch
from conftest import TINY_SHAPE, random_prompts

from pressroom import LLM, SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2,
                                 reason="needs two CUDA GPUs (a two-GPU machine: benchmarks/gpu/h200x2_tp.sh)")]

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, detokenize=False)
SHAPES = {"llama": dict(TINY_SHAPE),
          "llama-d128": dict(TINY_SHAPE, hidden_size=512, intermediate_size=1024, num_attention_heads=4,
                             num_key_value_heads=2)}  # the 8B models' head_dim; one KV head per rank


def _save(shape: dict, path) -> str:
    import transformers
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**shape), dtype=torch.float32)
    model.save_pretrained(path)
    return str(path)


def _tokens(path: str, prompts: list[list[int]], **kwargs) -> tuple[list[list[int]], bool]:
    """Greedy tokens, and whether the ranks replay CUDA graphs (rank 0's answer when it captured them)."""
    llm = LLM(path, device="cuda", skip_tokenizer_init=True, kv_cache_memory_gib=0.25, max_num_seqs=16, **kwargs)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs], llm.engine.core.cuda_graphs
    finally:
        llm.shutdown()


@pytest.mark.parametrize("name", list(SHAPES))
def test_two_gpus_give_the_tokens_of_one(name, tmp_path):
    path = _save(SHAPES[name], tmp_path)
    prompts = random_prompts(8, seed=11)
    one, graphs_one = _tokens(path, prompts, dtype="float32")
    two, graphs_two = _tokens(path, prompts, dtype="float32", tensor_parallel_size=2)
    assert graphs_one and graphs_two  # CUDA graphs on in both
    assert two == one


def test_the_embedded_model_over_two_gpus():
    """The embedded GGUF (carried to the GPU machine in parts; PRESSROOM_GGUF names it), dense fp32 weights."""
    path = os.environ.get("PRESSROOM_GGUF")
    if not path or not os.path.isfile(path):
        pytest.skip("PRESSROOM_GGUF does not name the embedded GGUF on this machine")
    prompts = random_prompts(4, seed=5)
    one, _ = _tokens(path, prompts, dtype="float32", quantization="none")
    two, _ = _tokens(path, prompts, dtype="float32", quantization="none", tensor_parallel_size=2)
    assert two == one
