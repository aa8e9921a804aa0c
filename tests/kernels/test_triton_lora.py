"""The gathered LoRA kernels (kernels/triton/lora.py; Triton's interpreter without a GPU) against the all-slots
products they replace for small steps: each token gets its own slot's update, slot -1 none, in place."""
from __future__ import annotations

import pytest
import torch

from pressroom.kernels.triton.lora import add_lora_updates

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU: Triton's interpreter


def all_slots_reference(out, x, a, b, token_slots, width):
    """lora/layers.py's products: x A_all^T masked to each token's slot, times B_all, added."""
    columns = torch.arange(a.shape[0]) // width
    mask = (columns[None, :] == token_slots[:, None]).to(torch.float32)
    return out.float() + ((x.float() @ a.float().t()) * mask) @ b.float().t()


@pytest.mark.parametrize("in_features, out_features, width, dtype", [
    (96, 80, 16, torch.float32),       # one slice of rank 16
    (1100, 130, 48, torch.float32),    # a fused qkv's three slices; inputs past one shrink chunk, ragged blocks
    (256, 192, 24, torch.bfloat16),    # a width that is no power of two, bf16 weights and activations
])
def test_each_token_gets_its_own_slots_update(in_features, out_features, width, dtype):
    gen = torch.Generator().manual_seed(in_features)
    slots, tokens = 4, 7
    x = torch.randn(tokens, in_features, generator=gen).to(dtype)
    a = (0.1 * torch.randn(slots * width, in_features, generator=gen)).to(dtype)
    b = (0.1 * torch.randn(out_features, slots * width, generator=gen)).to(dtype)
    token_slots = torch.tensor([2, -1, 0, 3, 3, -1, 1])
    out = torch.randn(tokens, out_features, generator=gen).to(dtype)
    want = all_slots_reference(out, x, a, b, token_slots, width)
    before = out.clone()
    on = [t.to(DEVICE) for t in (out, x, a, b, token_slots)]
    add_lora_updates(*on, width)
    out = on[0].cpu()
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), want, rtol=tol, atol=tol)
    assert torch.equal(out[token_slots < 0], before[token_slots < 0])  # the base model's tokens untouched
    assert not torch.allclose(out[token_slots >= 0], before[token_slots >= 0])  # the adapters' updates landed


def test_a_slots_update_reads_that_slot_alone():
    """Changing another slot's weights leaves a token's update unchanged."""
    gen = torch.Generator().manual_seed(5)
    x, width = torch.randn(2, 64, generator=gen), 16
    a, b = torch.randn(3 * width, 64, generator=gen), torch.randn(32, 3 * width, generator=gen)
    slots = torch.tensor([1, 1])
    x, a, b, slots = (t.to(DEVICE) for t in (x, a, b, slots))
    first = torch.zeros(2, 32, device=DEVICE)
    add_lora_updates(first, x, a, b, slots, width)
    a[:width] += 1.0
    b[:, 2 * width:] -= 1.0
    second = torch.zeros(2, 32, device=DEVICE)
    add_lora_updates(second, x, a, b, slots, width)
    assert torch.equal(first, second) and first.abs().sum() > 0
