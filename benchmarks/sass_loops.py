"""Instructions a weight value in the decode GEMVs' inner loops, on this machine without a GPU: each kernel is compiled
for an H100/H200 (sm_90) by Triton's bundled ptxas, disassembled by its nvdisasm, and the SASS between each loop's
head and its backward branch counted (registers and stack from cuobjdump). A proxy for the kernels' issue cost:
it says nothing of bandwidth or latency, which only the GPU measures (benchmarks/gpu/).

Pointers, the input length and row strides are marked 16-byte aligned, as Triton's JIT specializes them at real
shapes. Usage: python benchmarks/sass_loops.py [--baseline REV]  (REV: a git revision whose kernels print beside
today's, e.g. HEAD~3)
"""
from __future__ import annotations

import argparse
import collections
import importlib.util
import inspect
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # the tests' interpreter compiles nothing

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
ROOT = Path(__file__).resolve().parents[1]
THREADS_PER_WARP = 32


def _types(fn, constexprs: dict, types: dict) -> dict[str, str]:
    """The kernel's signature: constexprs, the given pointer types, else bf16 pointers and i32 integers."""
    sig = {}
    for name in inspect.signature(fn.fn).parameters:
        sig[name] = "constexpr" if name in constexprs else types.get(name) or (
            "*bf16" if name.endswith("_ptr") else "fp32" if name in ("alpha", "limit") else "i32")
    return sig


def loops_of(fn, constexprs: dict, types: dict, num_warps: int, num_stages: int) -> tuple[list[list[str]], dict]:
    """The SASS of each loop of `fn` compiled for sm_90, and its registers and stack bytes a thread."""
    sig = _types(fn, constexprs, types)
    names = list(sig)
    aligned = [n for n in names if sig[n].startswith("*") or n in ("K", "N", "k_in", "n_out") or n.startswith("stride")]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(fn, sig, {(names.index(k),): v for k, v in constexprs.items()}, attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": num_warps, "num_stages": num_stages})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        sass = subprocess.run([BIN / "nvdisasm", "-c", "-g", f.name], capture_output=True, text=True,
                              check=True).stdout
        usage = subprocess.run([BIN / "cuobjdump", "--dump-resource-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
    found = re.search(r"REG:(\d+).*?STACK:(\d+)", usage)
    resources = {"registers": int(found.group(1)), "stack": int(found.group(2))} if found else {}
    labels, ins = {}, []
    for line in sass.splitlines():
        if label := re.match(r"^\.(L_x_\d+):", line.strip()):
            labels[label.group(1)] = len(ins)
        elif op := re.search(r"/\*[0-9a-f]{4,}\*/\s+(.*?);", line):
            ins.append(op.group(1))
    loops = []
    for i, text in enumerate(ins):
        branch = re.search(r"BRA\s+(?:`\()?\.?(L_x_\d+)", text)
        if branch and labels.get(branch.group(1), i + 1) < i:  # a backward branch: a loop's body, more than itself
            loops.append(ins[labels[branch.group(1)]:i + 1])
    return loops, resources


def _opcode(text: str) -> str:
    return (text.split()[1] if text.startswith("@") else text.split()[0]).split(".")[0]


def report(label: str, fn, constexprs: dict, types: dict, num_warps: int, num_stages: int,
           weights_per_iteration: int) -> dict:
    """Prints and returns one kernel's loop instructions a weight value: all its loops, one pass of each, over the
    weights that pass reads (an older kernel's gate and up, or its top-k experts, loop one after another)."""
    loops, resources = loops_of(fn, constexprs, types, num_warps, num_stages)
    total = sum(len(body) for body in loops)
    per_thread = weights_per_iteration / (num_warps * THREADS_PER_WARP)
    ops = collections.Counter(_opcode(t) for body in loops for t in body)
    row = {"kernel": label, **resources, "loop_instructions": [len(b) for b in loops],
           "per_weight": round(total / per_thread, 2), "top": ops.most_common(6)}
    print(f"{label:58s} regs {resources.get('registers')} stack {resources.get('stack')}  "
          f"{row['per_weight']:5.2f} a weight  {', '.join(f'{k} {v}' for k, v in row['top'])}", flush=True)
    return row


FP8 = {"w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "ws_ptr": "*fp32", "ids_ptr": "*i32", "weights_ptr": "*fp32"}
FP4 = {"w_ptr": "*i32", "s_ptr": "*u8", "g_ptr": "*fp32", "ids_ptr": "*i32", "weights_ptr": "*fp32",
       "bias_ptr": "*fp32"}
FP8_GROUP = dict(MIN_AMAX=1e-12, FP8_LIMIT=448.0, GROUP=128, POW2=False)


def cases(quant_gemv, fused_moe, fused_moe_fp8) -> None:
    """Llama-3.1-8B's FP8 one-token GEMV (per-row scales), DeepSeek's FP8 expert GEMVs (weight-only and W8A8, top-6 as
    V2-Lite's), the MXFP4 expert GEMVs (top-4, gpt-oss's), the dense MXFP4 GEMV: each at its default launch."""
    launch = quant_gemv.FP8_DECODE
    report("quant_gemv._fp8_kernel (one token, per-row scale)", quant_gemv._fp8_kernel,
           dict(PER_ROW=True, HAS_BIAS=False, PRECISION="tf32", BLOCK_M=1, BLOCK_N=launch.block_n,
                BLOCK_K=launch.block_k), FP8, launch.num_warps, launch.num_stages, launch.block_n * launch.block_k)
    gemv = fused_moe_fp8.fp8_gemv_launch()
    staged = "STAGES" in inspect.signature(fused_moe_fp8._moe_fp8_up_gemv_kernel.fn).parameters
    extra = {"STAGES": gemv.num_stages} if staged else {}
    for a_fp8 in (False, True):
        tag = "W8A8" if a_fp8 else "weight-only"
        report(f"fused_moe_fp8 up GEMV ({tag})", fused_moe_fp8._moe_fp8_up_gemv_kernel,
               dict(FP8_GROUP, A_FP8=a_fp8, LIMITED=False, BLOCK_N=gemv.block_n, **extra), FP8, gemv.num_warps,
               gemv.num_stages, 2 * gemv.block_n * 128)
        # today's down pass holds the top-6 experts' tiles (8 with padding): fewer columns, as _gemv_moe_fp8 picks
        down_n = min(gemv.block_n, fused_moe.DOWN_TILE_WEIGHTS // (8 * 128)) if staged else gemv.block_n
        report(f"fused_moe_fp8 down-sum GEMV ({tag}, top-6)", fused_moe_fp8._moe_fp8_down_sum_gemv_kernel,
               dict(FP8_GROUP, A_FP8=a_fp8, TOP_K=6, BLOCK_N=down_n) | ({"PAIRS": 8, **extra} if staged else {}),
               FP8, gemv.num_warps, gemv.num_stages, 6 * down_n * 128)
    gemv = fused_moe.gemv_launch()
    fp4 = dict(BB=16, BLOCK_N=gemv.block_n, BLOCK_K=gemv.block_k)
    paired = "PAIRS" in inspect.signature(fused_moe._moe_fp4_down_sum_gemv_kernel.fn).parameters
    report("fused_moe MXFP4 up GEMV", fused_moe._moe_fp4_up_gemv_kernel, dict(fp4, HAS_BIAS=True, ACTIVATION=0), FP4,
           gemv.num_warps, 1, 2 * gemv.block_n * gemv.block_k)
    report("fused_moe MXFP4 down-sum GEMV (top-4)", fused_moe._moe_fp4_down_sum_gemv_kernel,
           dict(fp4, HAS_BIAS=True, TOP_K=4) | ({"PAIRS": 4} if paired else {}), FP4, gemv.num_warps, 1,
           4 * gemv.block_n * gemv.block_k)
    launch = quant_gemv.FP4_DECODE
    report("quant_gemv._fp4_gemv_kernel (one token, MXFP4)", quant_gemv._fp4_gemv_kernel,
           dict(HAS_BIAS=False, BB=16, BLOCK_N=launch.block_n, BLOCK_K=launch.block_k), FP4, launch.num_warps,
           launch.num_stages, 2 * launch.block_n * launch.block_k)


def _modules_at(rev: str) -> tuple:
    """The three kernel modules as of git revision `rev`, imported under their own names from a temporary copy."""
    out = []
    for name in ("quant_gemv", "fused_moe", "fused_moe_fp8"):
        text = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:pressroom/kernels/triton/{name}.py"],
                              capture_output=True, text=True, check=True).stdout
        path = Path(tempfile.mkdtemp()) / f"{name}_at_rev.py"
        path.write_text(text)
        spec = importlib.util.spec_from_file_location(f"{name}_at_rev", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        out.append(module)
    return tuple(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", help="a git revision whose kernels print first")
    args = parser.parse_args()
    if args.baseline:
        print(f"== {args.baseline}")
        cases(*_modules_at(args.baseline))
        print("== this tree")
    from pressroom.kernels.triton import fused_moe, fused_moe_fp8, quant_gemv
    cases(quant_gemv, fused_moe, fused_moe_fp8)


if __name__ == "__main__":
    main()
