"""A start precompiles, in other processes, the Triton kernels the previous start recorded (issue 44: time to
ready): the second of two cold starts (each in a fresh process with an empty Triton cache; only the manifest is
kept) compiles fewer of pressroom's kernels in its own process, none that the pool compiled too (its JIT takes a
kernel out of the pool's queue or waits for the pool process compiling it), and generates the same greedy tokens.
Both starts' time to ready and phases are printed (`pytest -s`). Token ids only: the GPU machine has no tokenizer
files."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import TINY_SHAPE

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the H200 machine)")]

# One start, in a fresh interpreter (Triton's JIT keeps compiled kernels in memory for the life of a process):
# counts the compiles the process itself does while the engine starts (Triton's compilation listener: a cache
# miss is a compile here), then generates greedily; prints one RESULT line of JSON.
START = r"""
import json, sys
from triton import knobs
from pressroom import LLM, SamplingParams

compiles = []
def listen(src, metadata, metadata_group, times, cache_hit):
    if not cache_hit:
        fn = getattr(src, "fn", None)
        compiles.append(f"{getattr(fn, '__module__', '?')}.{getattr(src, 'name', '?')}")
knobs.compilation.listener = listen
llm = LLM(sys.argv[1], device="cuda", dtype="float32", skip_tokenizer_init=True, kv_cache_memory_gib=0.25,
          max_num_seqs=8, max_cudagraph_capture_size=8)
start_compiles = list(compiles)
kernels = llm.engine.core.executor.driver_worker._kernels
result = kernels.wait(60) if kernels is not None else None  # a start does not wait for the whole pool
params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, detokenize=False)
outs = llm.generate([{"prompt_token_ids": list(range(3 + i, 40 + 7 * i))} for i in range(4)], params, use_tqdm=False)
print("RESULT " + json.dumps({
    "startup_seconds": llm.engine.startup_seconds, "phases": llm.engine.startup_phases,
    "start_compiles": start_compiles, "precompiled": result.compiled if result else None,
    "precompile_failed": result.failed if result else None, "precompile_workers": result.workers if result else None,
    "tokens": [list(o.outputs[0].token_ids) for o in outs]}), flush=True)
llm.shutdown()
"""


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    import transformers
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**TINY_SHAPE), dtype=torch.float32)
    path = str(tmp_path_factory.mktemp("llama"))
    model.save_pretrained(path)
    return path


def _start(model: str, root, n: int, manifests=None) -> dict:
    """One cold start: a fresh Triton cache and pressroom cache (holding only `manifests`, if given)."""
    pressroom_cache, triton_cache = root / f"pressroom-{n}", root / f"triton-{n}"
    if manifests is not None:
        shutil.copytree(manifests, pressroom_cache / "triton-manifests")
    env = dict(os.environ, PRESSROOM_CACHE=str(pressroom_cache), TRITON_CACHE_DIR=str(triton_cache))
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, "-c", START, model], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    out = json.loads(line[len("RESULT "):])
    out["manifests"] = pressroom_cache / "triton-manifests"
    out["log"] = [x for x in done.stderr.splitlines() if "Triton kernels" in x]
    return out


def test_the_second_start_compiles_fewer_kernels_itself_and_none_twice(llama_dir, tmp_path):
    first = _start(llama_dir, tmp_path, 1)
    second = _start(llama_dir, tmp_path, 2, manifests=first["manifests"])
    for name, run in (("first", first), ("second", second)):
        phases = ", ".join(f"{k} {v:.2f} s" for k, v in run["phases"].items())
        print(f"\n{name} start: ready in {run['startup_seconds']:.2f} s ({phases}); compiled in-process "
              f"{len(run['start_compiles'])}, precompiled {run['precompiled']} in {run['precompile_workers']} "
              f"processes ({run['precompile_failed']} failed)\n  " + "\n  ".join(run["log"]))
    ours = [c for c in first["start_compiles"] if c.startswith("pressroom.")]
    assert ours, "the first start compiled no pressroom kernel: nothing was recorded"
    assert first["precompiled"] is None  # no manifest yet
    saved = list(first["manifests"].glob("*.json"))
    assert len(saved) == 1 and json.loads(saved[0].read_text())["entries"]
    second_ours = [c for c in second["start_compiles"] if c.startswith("pressroom.")]
    assert second["precompiled"] > 0 and second["precompile_failed"] == 0
    assert len(second_ours) < len(ours)  # the pool compiled the rest
    assert second["precompiled"] + len(second_ours) <= len(ours)  # and no kernel was compiled by both
    assert second["tokens"] == first["tokens"]
