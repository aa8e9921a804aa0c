"""DFlash2's block drafter pieces: target features at chosen layers, the dynamic convolution's
locality, attention with no causal mask inside the block, and context padding that changes nothing."""
from __future__ import annotations

import pytest
import torch

from pressroom import LLM
from pressroom.spec_decode.dflash2 import DFlash2Config, DFlash2Drafter, GroupedDynamicConv


def test_aux_layers_are_hf_hidden_states(tiny_model_dir):
    import transformers

    from pressroom.attention.backend import AttentionMetadata, forward_context
    path = tiny_model_dir("llama")
    llm = LLM(path, dtype="float32", kv_cache_memory_gib=0.05)
    ids = torch.tensor([5, 17, 99, 3, 250])
    n = len(ids)

    def forward(*aux_layers: int):
        meta = AttentionMetadata(num_decodes=0, num_decode_tokens=0, slot_mapping=torch.arange(16, 16 + n),
                                 block_tables=torch.tensor([[1]]), seq_lens=torch.tensor([n]),
                                 query_start_loc=[0, n], seq_lens_host=[n])
        with torch.inference_mode(), forward_context(meta):
            return llm.engine.model(ids, torch.arange(n), aux_layers)

    plain = forward()
    hidden, aux = forward(0, 1)
    assert torch.equal(hidden, plain)  # asking for the layers changes nothing else
    reordered = forward(1, 0)[1]  # in the order asked
    assert torch.equal(reordered[0], aux[1]) and torch.equal(reordered[1], aux[0])
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    states = hf(ids[None], output_hidden_states=True).hidden_states
    for ours, layer in zip(aux, (0, 1)):
        if layer == len(hf.model.layers) - 1:
            continue  # HF's last entry is after the final norm
        assert torch.allclose(ours, states[layer + 1][0], atol=1e-4)


def test_dynamic_conv_mixes_only_the_slots_before():
    torch.manual_seed(0)
    conv = GroupedDynamicConv(width=16, kernel=3, group_size=4)
    torch.nn.init.normal_(conv.delta.weight, std=0.3)
    torch.nn.init.normal_(conv.base, std=0.3)
    x = torch.randn(2, 8, 16)
    y = conv(x)
    x2 = x.clone()
    x2[:, 4] += 1.0
    changed = (conv(x2) - y).abs().amax(dim=(0, 2)) > 1e-6
    assert changed.tolist() == [False] * 4 + [True] * 3 + [False]  # slot 4 reaches slots 4, 5, 6 only


def test_block_attends_both_ways_and_ignores_padded_context():
    torch.manual_seed(1)
    cfg = DFlash2Config(block_size=4, target_layers=(0, 1), num_heads=2, conv_kernel_size=2, conv_group_size=8)
    drafter = DFlash2Drafter(width=16, cfg=cfg, vocab_size=40)
    features = torch.randn(1, 5, 32)
    mask = torch.tensor([[False, True, True, True, True]])  # the first position is padding
    anchor = torch.randn(1, 16, requires_grad=True)
    out = drafter(features, mask, anchor)
    assert out.shape == (1, 4, 16)
    slots = drafter.slots
    grad = torch.autograd.grad(out[0, 0].sum(), slots)[0]
    assert grad[3].abs().sum() > 0  # slot 0 reads slot 3: no causal mask inside the block
    padded = features.clone()
    padded[0, 0] += 100.0
    assert torch.allclose(drafter(padded, mask, anchor), out, atol=1e-5)


def test_config_is_validated():
    with pytest.raises(ValueError):
        DFlash2Config(block_size=0)
    with pytest.raises(ValueError, match="divide"):
        GroupedDynamicConv(width=10, kernel=2, group_size=4)


def _random_drafter(target_dir: str, path, layers=(0, 1), seed: int = 0) -> str:
    from pressroom.model.loader import load_hf_config
    from pressroom.spec_decode.dflash2 import save_drafter
    hf = load_hf_config(target_dir)
    torch.manual_seed(seed)
    cfg = DFlash2Config(block_size=4, target_layers=layers, num_heads=2, conv_kernel_size=2, conv_group_size=16,
                        top_m=4, rank=8)
    save_drafter(DFlash2Drafter(hf.hidden_size, cfg, hf.vocab_size), str(path))
    return str(path)


def test_dflash2_greedy_equals_no_speculation(tiny_model_dir, tmp_path):
    from conftest import random_prompts

    from pressroom import SamplingParams
    target = tiny_model_dir("llama")
    drafter = _random_drafter(target, tmp_path / "drafter")
    prompts = random_prompts(5, low=5, high=40, seed=41)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    def run(**spec):
        llm = LLM(target, dtype="float32", kv_cache_memory_gib=0.05, **spec)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs], llm

    plain, _ = run()
    spec, llm = run(speculative_config={"method": "dflash2", "model": drafter, "num_speculative_tokens": 4,
                                        "adaptive_token_budget": False})
    assert spec == plain
    stats = llm.engine.stats().spec
    assert stats.num_drafts > 20  # an untrained drafter: drafts verified, few accepted
    # Every draft verified on its own (the first of each, and each after an accepted one) is a point of
    # the drafter's calibration table; with a fixed K no budget plans with calibrated ones.
    assert stats.num_drafts <= stats.stated.total <= stats.num_drafts + stats.num_accepted_tokens
    assert stats.calibrated.total == 0
    assert llm.engine.kv_cache.usage() == 0.0


def test_dflash2_rejects_a_drafter_for_another_target(tiny_model_dir, tmp_path):
    drafter = _random_drafter(tiny_model_dir("llama"), tmp_path / "d", layers=(0, 7))
    with pytest.raises(ValueError, match="layers"):
        LLM(tiny_model_dir("llama"), dtype="float32", kv_cache_memory_gib=0.05,
            speculative_config={"method": "dflash2", "model": drafter})
