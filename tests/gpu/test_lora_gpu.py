"""LoRA adapters on CUDA: four adapters and the base model in one batch against PEFT's merged models (fp32, HF on
the CPU), with CUDA graphs on: steps with adapters replay graphs captured with them (each token's slot a graph input),
as steps without do; decode steps on the fused kernel and larger ones on the grouped kernels, or every step on the
grouped ones (kernels/triton/lora.py)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the H200 machine)")]

sys.path.insert(0, str(Path(__file__).parents[1] / "lora"))

from test_lora import ADAPTERS, NEW_TOKENS, merged, requests, write_adapter  # noqa: E402

from pressroom import LLM, SamplingParams  # noqa: E402


@pytest.mark.parametrize("fused_max_tokens", [16, 0])  # decodes on the fused kernel, or every step grouped
def test_adapters_match_peft_on_cuda(tmp_path, monkeypatch, fused_max_tokens):
    import transformers

    from pressroom.kernels.triton import lora as kernels
    from pressroom.lora import layers
    monkeypatch.setattr(layers, "FUSED_MAX_TOKENS", fused_max_tokens)
    launched = {"add_lora_fused": 0, "add_lora_grouped": 0}  # calls: graph captures and eager steps

    def counted(name, kernel):
        def launch(*args):
            launched[name] += 1
            kernel(*args)
        return launch
    for name in launched:
        monkeypatch.setattr(kernels, name, counted(name, getattr(kernels, name)))
    from conftest import TINY_SHAPE, hf_greedy, random_prompts
    base = tmp_path / "base"  # no tokenizer: the GPU image lacks the embedded model
    torch.manual_seed(1234)
    transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**TINY_SHAPE)).save_pretrained(base)
    paths = {}
    for i, (name, (rank, targets, extra)) in enumerate(ADAPTERS.items()):
        paths[name] = str(tmp_path / name)
        write_adapter(str(base), tmp_path / name, rank, targets, seed=10 + i, **dict(extra))
    loras = requests(paths)
    names = [*ADAPTERS, None]
    prompts = random_prompts(len(names), low=5, high=30, seed=3)
    llm = LLM(str(base), device="cuda", dtype="float32", skip_tokenizer_init=True, enable_lora=True, max_loras=4,
              max_lora_rank=16, gpu_memory_utilization=0.3)
    assert llm.engine.core.cuda_graphs
    graphs = llm.engine.core.executor.driver_worker.model_runner.graphs
    assert graphs.lora_slots == 4
    replays, replay = [], graphs.replay
    graphs.replay = lambda *a, **k: replays.append(a[0]) or replay(*a, **k)  # counts, then replays
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                        lora_request=[loras[n] if n else None for n in names])
    for name, prompt, out in zip(names, prompts, outs):
        assert list(out.outputs[0].token_ids) == hf_greedy(merged(str(base), paths.get(name)), prompt, NEW_TOKENS)
    assert len(replays) >= NEW_TOKENS - 1  # the decode steps, every one with adapters, replayed graphs
    assert launched["add_lora_grouped"] > 0  # prefills (and with 0, the decode graphs' captures)
    assert (launched["add_lora_fused"] > 0) == (fused_max_tokens > 0)  # the decode graphs' captures
    del graphs.replay, graphs  # the spy's reference cycle would keep this engine's memory past its shutdown
    llm.shutdown()
