"""The recurrent families on CUDA through the engine, against HF transformers on the same tiny random weights
(fp32, HF on the CPU): greedy tokens for 64 new tokens equal HF's recomputed greedy, prompt logprobs within
1e-3, in one batch of mixed lengths with prompts longer than several 64-token chunks; eager, and with decode
steps replayed from CUDA graphs (the state slots a graph input); a second pass restores checkpointed states."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the H200 machine)")]

sys.path.insert(0, str(Path(__file__).parents[1] / "model"))

from pressroom import LLM, SamplingParams  # noqa: E402

MAX_TOKENS = 64
LENGTHS = (7, 40, 150, 97, 200)


def _mamba(version: int):
    def save(path: Path):
        from test_mamba import save_tiny_mamba
        return save_tiny_mamba(version, str(path))
    return save


def _nemotron_h(path: Path):
    from test_nemotron_h import nemotron_model_config, save_tiny
    return save_tiny(nemotron_model_config(), path)


def _falcon_h1(path: Path):
    from test_falcon_h1 import MODEL_MULTIPLIERS, MODEL_SHAPE
    from test_nemotron_h import save_tiny
    from transformers import FalconH1Config
    return save_tiny(FalconH1Config(**MODEL_SHAPE, **MODEL_MULTIPLIERS), path)


def _qwen3_next(path: Path):
    import transformers
    from test_qwen3_next import randomize_, tiny_config
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(), dtype=torch.float32)
    randomize_(model, torch.Generator().manual_seed(7))
    model.save_pretrained(path)
    return model.eval()


def _kimi_linear(path: Path):
    from test_kimi_linear import kimi_config, save_tiny_kimi
    return save_tiny_kimi(path, kimi_config())


FAMILIES = {"mamba": _mamba(1), "mamba2": _mamba(2), "nemotron_h": _nemotron_h, "falcon_h1": _falcon_h1,
            "qwen3_next": _qwen3_next, "kimi_linear": _kimi_linear}


@torch.inference_mode()
def _hf_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens by recomputing the whole sequence each time (no cache: HF's caches differ by family)."""
    seq = list(prompt)
    for _ in range(max_tokens):
        seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]


@torch.inference_mode()
def _hf_prompt_logprobs(model, prompt: list[int]) -> list[float]:
    logits = model(torch.tensor([prompt])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(prompt[1:])[:, None])[:, 0].tolist()


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"tiny-{request.param}")
    hf_model = FAMILIES[request.param](path)
    vocab = hf_model.config.vocab_size
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, min(vocab, 4096), (n,), generator=g).tolist() for n in LENGTHS]
    expected = [(_hf_greedy(hf_model, p, MAX_TOKENS), _hf_prompt_logprobs(hf_model, p)) for p in prompts]
    return request.param, str(path), prompts, expected


@pytest.mark.parametrize("graphs", [False, True])
def test_family_matches_hf_on_cuda(family, graphs):
    name, path, prompts, expected = family
    llm = LLM(path, device="cuda", dtype="float32", skip_tokenizer_init=True, enforce_eager=not graphs,
              max_num_batched_tokens=64, gpu_memory_utilization=0.3, block_size=16, mamba_block_size=32)
    assert bool(llm.engine.core.cuda_graphs) == graphs
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for out, (tokens, logprobs) in zip(outs, expected):
        assert out.outputs[0].token_ids == tokens, name
        ours = [next(iter(pos.values())).logprob for pos in out.prompt_logprobs[1:]]
        assert max(abs(a - b) for a, b in zip(ours, logprobs)) < 1e-3, name
    # again without prompt logprobs: the prompts' checkpointed states are restored, the rest recomputed
    again = llm.generate([{"prompt_token_ids": p} for p in prompts],
                         SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    assert [o.num_cached_tokens for o in again] == [(n - 1) // 32 * 32 for n in LENGTHS]
    assert [o.outputs[0].token_ids for o in again] == [t for t, _ in expected]
    llm.shutdown()
