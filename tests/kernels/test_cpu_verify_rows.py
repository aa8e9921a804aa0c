"""The 4-bit row kernel (kernels/csrc/quant_ops.c) over a verification's 1 + K rows: every row's output is, to the
bit, what that token alone gives (else greedy speculation drifts from plain decoding), whichever pass the row
falls in (up to 12 tokens share one unpacking of a block on AVX-512, 4 on AVX2), and equal to the 4-bit panel's
(vnni_gemm.c), which the fused decode stack (decode_stack.c) takes past the row kernel's count."""
from __future__ import annotations

import pytest
import torch

from pressroom.kernels import cpu
from pressroom.model.layers.quant import NibbleMatrix, Q4Weight, q4_panels

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no C compiler: the torch int4 kernel is used instead")


def _matrix(rows: int, cols: int, seed: int) -> NibbleMatrix:
    gen = torch.Generator().manual_seed(seed)
    return NibbleMatrix.pack(Q4Weight(torch.randint(0, 16, (rows, cols), generator=gen, dtype=torch.uint8),
                                      torch.rand(rows, cols // 32, generator=gen) * 0.05,
                                      torch.rand(rows, cols // 32, generator=gen) * -0.4))


def _rows(tokens: int, cols: int, seed: int) -> torch.Tensor:
    """Activations of very different sizes a row (the embedded model's outlier channels), a zero block, and a
    value on a rounding tie (x * 127 / amax = 63.5)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, cols, generator=gen) * 10.0 ** torch.randint(-3, 3, (tokens, 1), generator=gen)
    x[0, :32] = 0.0
    x[-1, 32] = 127.0
    x[-1, 33] = 63.5
    return x


def _q4(x: torch.Tensor, w: NibbleMatrix) -> torch.Tensor:
    return cpu.q4_matmul(x.contiguous(), w.qs, w.scale, w.min, w.rows)


@pytest.mark.parametrize("rows, cols", [(960, 576), (37, 96), (20, 1536)])  # 37, 20: a part-filled last tile
def test_each_row_of_a_verification_has_its_decodes_bits(rows, cols):
    w = _matrix(rows, cols, rows)
    for tokens in (2, 5, 9, 12, 13):  # 13: a full pass of 12, then one token alone
        x = _rows(tokens, cols, tokens)
        together = _q4(x, w)
        for t in range(tokens):
            assert torch.equal(_q4(x[t:t + 1], w), together[t:t + 1]), (tokens, t)
        ref = x @ _dense(w).t()
        assert ((together - ref).abs() <= 0.02 * ref.abs().amax(dim=1, keepdim=True)).all()


def _dense(w: NibbleMatrix) -> torch.Tensor:
    """The matrix as fp32 [rows, cols], read back through the kernel: an identity row rounds exactly (one value
    a block, 1.0 -> 127 at scale 1/127)."""
    cols = w.qs.shape[1] // 128 * 32
    return cpu.q4_matmul(torch.eye(cols), w.qs, w.scale, w.min, w.rows).t()


@pytest.mark.skipif(not q4_panels(), reason="no 4-bit panel in this build")
def test_the_row_kernel_and_the_panel_agree_on_9_to_12_rows():
    # the fused stack now keeps these counts on the row kernel (before: the panel): the tokens must not change
    w = _matrix(96, 576, 3)
    for tokens in (9, 10, 12):
        x = _rows(tokens, 576, tokens)
        assert torch.equal(_q4(x, w), w.panel.matmul(x)), tokens
