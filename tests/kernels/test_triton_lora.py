"""The LoRA kernels (kernels/triton/lora.py; Triton's interpreter without a GPU) against a torch reference: the fused
one-launch kernel of decode steps and the grouped (by slot) shrink and expand of larger steps. Each token gets its own
slot's update, slot -1 none, in place; fused layers' slices, padded ranks, ragged blocks, bf16 and fp32."""
from __future__ import annotations

import pytest
import torch

from pressroom.kernels.triton import lora as kernels

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU: Triton's interpreter
SLOTS = 4


def adapter_weights(in_features, slices, max_rank, ranks, dtype, seed):
    """LoRASlots' layout: a [slots * W, in], b [out, slots * W] with W = len(slices) * max_rank; slot k's slice j a
    rank ranks[k] adapter (rows and columns past it zero: a padded width), B zero outside the slice's features."""
    gen = torch.Generator().manual_seed(seed)
    width, out_features = len(slices) * max_rank, sum(size for _, size in slices)
    a = torch.zeros(len(ranks) * width, in_features)
    b = torch.zeros(out_features, len(ranks) * width)
    for k, rank in enumerate(ranks):
        for j, (offset, size) in enumerate(slices):
            col = k * width + j * max_rank
            a[col:col + rank] = 0.1 * torch.randn(rank, in_features, generator=gen)
            b[offset:offset + size, col:col + rank] = 0.1 * torch.randn(size, rank, generator=gen)
    return a.to(dtype), b.to(dtype)


def reference(out, x, a, b, token_slots, width):
    """lora/layers.py's CPU products: x A_all^T masked to each token's slot, times B_all, added (in fp32)."""
    columns = torch.arange(a.shape[0]) // width
    mask = (columns[None, :] == token_slots[:, None]).to(torch.float32)
    return out.float() + ((x.float() @ a.float().t()) * mask) @ b.float().t()


def run_kernel(kernel, out, x, a, b, token_slots, slices, max_rank):
    """Applies `kernel` ('fused' or 'grouped') on DEVICE; returns out on the CPU."""
    table = torch.tensor(slices, dtype=torch.int32)
    return run_layout(kernel, out, x, a, b, token_slots, (table, max(size for _, size in slices), max_rank))


def run_layout(kernel, out, x, a, b, token_slots, layout):
    """As run_kernel, with the kernels' layout arguments (slice table, largest slice, rank) as given."""
    out, x, a, b, token_slots = (t.to(DEVICE) for t in (out, x, a, b, token_slots))
    layout = (layout[0].to(DEVICE), *layout[1:])
    if kernel == "fused":
        kernels.add_lora_fused(out, x, a, b, token_slots, *layout)
    else:
        kernels.add_lora_grouped(out, x, a, b, kernels.group_by_slot(token_slots, SLOTS), *layout)
    return out.cpu()


def uneven_slots(tokens, seed):
    """Token slots in [-1, SLOTS), shuffled: five in six on slot 1 (33 of 40 tokens: a BLOCK_M tile and a partial
    one), the rest on slots 0, 2 and -1 in turn, none on slot 3."""
    many = tokens * 5 // 6
    slots = torch.tensor([1] * many + [(0, 2, -1)[i % 3] for i in range(tokens - many)])
    return slots[torch.randperm(tokens, generator=torch.Generator().manual_seed(seed))]


LAYERS = {  # name: (in_features, slices, max_rank, each slot's rank, dtype)
    "plain fp32, ranks 8/16": (96, [(0, 80)], 16, (8, 16, 16, 8), torch.float32),
    "qkv bf16, ragged input": (200, [(0, 64), (64, 32), (96, 32)], 16, (16, 8, 16, 16), torch.bfloat16),
    "gate_up fp32, ranks 8/64": (72, [(0, 150), (150, 150)], 64, (64, 8, 64, 16), torch.float32),
    "down bf16, split input": (2100, [(0, 130)], 16, (16, 16, 8, 16), torch.bfloat16),
    "qkv fp32, ranks to 128": (40, [(0, 48), (48, 16), (64, 16)], 128, (128, 8, 32, 128), torch.float32),
}


def check_layer(kernel, layer, tokens, seed):
    in_features, slices, max_rank, ranks, dtype = LAYERS[layer]
    a, b = adapter_weights(in_features, slices, max_rank, ranks, dtype, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(tokens, in_features, generator=gen).to(dtype)
    out = torch.randn(tokens, sum(size for _, size in slices), generator=gen).to(dtype)
    token_slots = uneven_slots(tokens, seed)
    want = reference(out, x, a, b, token_slots, len(slices) * max_rank)
    got = run_kernel(kernel, out.clone(), x, a, b, token_slots, slices, max_rank)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
    base = token_slots < 0
    assert torch.equal(got[base], out[base])  # the base model's tokens untouched
    assert not torch.allclose(got[~base].float(), out[~base].float())  # the adapters' updates landed


@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("tokens", [1, 16])
def test_fused_kernel_gives_each_token_its_own_slots_update(layer, tokens):
    check_layer("fused", layer, tokens, seed=tokens)


@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("tokens", [1, 17, 40])
def test_grouped_kernels_give_each_token_its_own_slots_update(layer, tokens):
    check_layer("grouped", layer, tokens, seed=tokens)


def test_grouping_is_a_stable_sort_by_slot_with_the_base_models_tokens_last():
    token_slots = torch.tensor([2, -1, 0, 2, 2, -1, 0, 1] + [1] * 33)
    groups = kernels.group_by_slot(token_slots, SLOTS)
    order = groups.order.long()
    assert order.tolist() == [2, 6, 7, *range(8, 41), 0, 3, 4, 1, 5]
    assert groups.starts.tolist() == [0, 2, 36, 39, 39]  # slot 3: no tokens
    assert groups.tile_starts.tolist() == [0, 1, 3, 4, 4]  # slot 1's 34 tokens: two tiles of 32
    assert groups.max_tiles >= groups.tile_starts[-1].item()


@pytest.mark.parametrize("kernel", ["fused", "grouped"])
def test_a_slots_update_reads_that_slot_alone(kernel):
    """Changing another slot's weights leaves a token's update unchanged; tokens of no slot get nothing."""
    gen = torch.Generator().manual_seed(5)
    width, slices = 16, [(0, 32)]
    x = torch.randn(3, 64, generator=gen)
    a, b = torch.randn(SLOTS * width, 64, generator=gen), torch.randn(32, SLOTS * width, generator=gen)
    token_slots = torch.tensor([1, -1, 1])
    first = run_kernel(kernel, torch.zeros(3, 32), x, a, b, token_slots, slices, width)
    a[:width] += 1.0
    b[:, 2 * width:] -= 1.0
    second = run_kernel(kernel, torch.zeros(3, 32), x, a, b, token_slots, slices, width)
    assert torch.equal(first, second) and first.abs().sum() > 0 and not first[1].any()


@pytest.mark.parametrize("kernel, tokens", [("fused", 5), ("grouped", 37)])
@pytest.mark.parametrize("fused", ["qkv", "gate_up"])
def test_the_kernels_read_lora_slots_layout(kernel, tokens, fused):
    """A real fused layer's LoRASlots (adapters on some of its slices, of ranks below the slots' 16) through the
    kernels equals its CPU hook's all-slots products: the slice table, widths and columns agree."""
    from pressroom.lora.adapter import LoRAUpdate
    from pressroom.lora.layers import LoRASlots, LoRAStep, lora_step
    from pressroom.model.layers.linear import MergedColumnParallelLinear, QKVParallelLinear
    layer = QKVParallelLinear(64, 16, 4, 2) if fused == "qkv" else MergedColumnParallelLinear(64, [96, 80])
    slots = LoRASlots(layer, SLOTS, 16, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(7)
    for slot, (j, rank) in enumerate([(0, 8), (len(slots.slices) - 1, 16), (0, 4)]):  # slot 3 left empty
        offset, size = slots.slices[j]
        slots.write(slot, LoRAUpdate(f"{fused}", offset, size, torch.randn(rank, 64, generator=gen),
                                     torch.randn(size, rank, generator=gen), 0.5))
    x = torch.randn(tokens, 64, generator=gen)
    out = torch.randn(tokens, layer.out_features, generator=gen)
    token_slots = torch.randint(-1, SLOTS, (tokens,), generator=gen)
    with lora_step(LoRAStep(token_slots, SLOTS)):
        want = slots._add_updates(layer, (x,), out.clone())
    layout = (slots.slice_table, slots.largest_slice, slots.max_rank)  # as the layer's hook passes them on CUDA
    got = run_layout(kernel, out.clone(), x, slots.a, slots.b, token_slots, layout)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(got, out)


def apply_on_cuda(out, x, a, b, token_slots, table, max_rank):
    """The kernel lora/layers.py picks for this many tokens, into a zeroed out."""
    out.zero_()
    if x.shape[0] <= 16:
        kernels.add_lora_fused(out, x, a, b, token_slots, table, 4096, max_rank)
    else:
        kernels.add_lora_grouped(out, x, a, b, kernels.group_by_slot(token_slots, 16), table, 4096, max_rank)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: CUDA graphs")
@pytest.mark.parametrize("in_features, slices", [(4096, [(0, 4096), (4096, 1024), (5120, 1024)]),  # qkv
                                                 (14336, [(0, 4096)])])  # down
@pytest.mark.parametrize("tokens", [1, 16, 300])  # fused; fused at its largest; grouped with split inputs
def test_kernels_replay_in_cuda_graphs_at_llama_8b_shapes(in_features, slices, tokens):
    """Captured once, replayed with other slots written into the graph's input: the kernels read the slots and the
    grouping on the device (no host sync: capture would fail), 16 slots of rank 16 at the 8B shape's layers."""
    slots, max_rank = 16, 16
    width, out_features = len(slices) * max_rank, sum(size for _, size in slices)
    a, b = (t.cuda() for t in adapter_weights(in_features, slices, max_rank, [16] * slots, torch.bfloat16, 0))
    x = torch.randn(tokens, in_features, generator=torch.Generator().manual_seed(1)).to("cuda", torch.bfloat16)
    out = torch.zeros(tokens, out_features, device="cuda", dtype=torch.bfloat16)
    token_slots = torch.full((tokens,), -1, dtype=torch.int64, device="cuda")
    args = (out, x, a, b, token_slots, torch.tensor(slices, dtype=torch.int32, device="cuda"), max_rank)
    apply_on_cuda(*args)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        apply_on_cuda(*args)
    for seed in (1, 2):
        token_slots.copy_(torch.randint(-1, slots, (tokens,), generator=torch.Generator().manual_seed(seed)))
        graph.replay()
        want = reference(torch.zeros(tokens, out_features), x.cpu(), a.cpu(), b.cpu(), token_slots.cpu(), width)
        # updates up to ~30: the grouped expand multiplies a bf16 copy of the shrink (as torch's bf16 products do)
        torch.testing.assert_close(out.float().cpu(), want, rtol=3e-2, atol=0.1)
