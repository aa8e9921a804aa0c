"""Progress bars a vLLM user sees (issue 46 item 8): loading the weights counts the checkpoint's tensors on
stderr, on tensor-parallel rank 0 only; the engine core's warm-up (CUDA only in service; run here on the CPU by
hand) counts its steps; LLM.generate counts finished prompts, one prompt too, with vLLM's token
speeds. (`bench serve`'s bar: tests/benchmarks/test_bench_serve.py.)"""
from __future__ import annotations

from safetensors import safe_open

from pressroom import LLM, SamplingParams
from pressroom.model import loader


def _tensors(path: str) -> int:
    with safe_open(f"{path}/model.safetensors", framework="pt") as f:
        return len(f.keys())


def test_other_ranks_show_no_bar_and_every_weight_passes(capsys, monkeypatch):
    import pressroom.distributed.parallel_state as ps
    weights = [("a", 1), ("b", 2), ("c", 3)]
    monkeypatch.setattr(ps, "get_tp_rank", lambda: 1)
    assert list(loader._with_progress(iter(weights), 3)) == weights
    assert "Loading weights" not in capsys.readouterr().err
    monkeypatch.setattr(ps, "get_tp_rank", lambda: 0)
    assert list(loader._with_progress(iter(weights), 5)) == weights  # a GGUF's estimate: ends at what loaded
    assert "Loading weights: 100%" in capsys.readouterr().err


def test_loading_and_generate_show_bars(tiny_model_dir, capsys):
    """LLM(...) loads the weights behind a bar to the checkpoint's last tensor; generate counts its prompts, a
    single one too, with vLLM's token speeds; use_tqdm=False shows nothing."""
    path = tiny_model_dir("llama")
    capsys.readouterr()
    llm = LLM(model=path, dtype="float32", max_model_len=128)
    err = capsys.readouterr().err
    n = _tensors(path)
    assert "Loading weights: 100%" in err and f" {n}/{n} " in err, err
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    llm.generate("one prompt", params)
    err = capsys.readouterr().err
    assert "Processed prompts: 100%" in err and " 1/1 " in err and "est. speed input: " in err, err
    llm.generate(["a", "b", "c"], params)
    assert " 3/3 " in capsys.readouterr().err
    llm.generate("quiet", params, use_tqdm=False)
    assert "Processed prompts" not in capsys.readouterr().err


def test_warm_up_counts_its_steps_and_leaves_the_core_idle(tiny_model_dir, capsys):
    from pressroom.config import EngineArgs
    from pressroom.engine.core import EngineCore
    args = EngineArgs(model=tiny_model_dir("llama"), dtype="float32", kv_cache_memory_gib=0.05, max_num_seqs=2,
                      max_num_batched_tokens=128)
    core = EngineCore(args.create_engine_config())
    capsys.readouterr()
    core._warm_up_step_shapes()
    err = capsys.readouterr().err
    # max_num_seqs 2: counts 1 and 2, 7 query lengths each (1 + 7 steps per count), one chunked step of 2 prompts
    assert "Warming up step shapes: 100%" in err and " 17/17 " in err, err
    assert not core.has_unfinished_requests() and core.kv_cache.usage() == 0.0
