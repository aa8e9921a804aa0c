"""Whisper's encoder through its CUDA graphs (tiny random Whisper, fp32): three clips of different lengths in one
batch give HF's greedy tokens with the encoder replayed from a two-clip bucket's graph, and the same tokens with
--enforce-eager. The padding itself is checked on the CPU (tests/multimodal/test_encoder_graphs.py)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the H200 machine)")]

sys.path.insert(0, str(Path(__file__).parents[1] / "multimodal"))

from test_whisper import NEW_TOKENS, RATE, _audio_prompt, build_tiny_whisper, hf_greedy, tone  # noqa: E402

from pressroom import LLM, SamplingParams  # noqa: E402


def test_whisper_encoder_graphs_give_hfs_tokens(tmp_path):
    model, tok = build_tiny_whisper(tmp_path)
    path = str(tmp_path)
    clips = [tone(1.5, [220, 440], 0), tone(4.0, [330], 1), tone(7.0, [150, 600, 900], 2)]
    want = hf_greedy(path, model, tok, clips)
    prompts = [_audio_prompt(tok, c, RATE) for c in clips]
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
    window = 2 * model.config.max_source_positions
    got = {}
    for eager in (False, True):
        llm = LLM(path, device="cuda", dtype="float32", gpu_memory_utilization=0.2, enforce_eager=eager,
                  encoder_cudagraph_sizes=[2 * window])
        graphs = llm.engine.core.executor.driver_worker.model_runner.encoder_graphs
        assert (graphs is None) == eager
        got[eager] = [list(r.outputs[0].token_ids) for r in llm.generate(prompts, greedy, use_tqdm=False)]
        if not eager:
            assert graphs.graphs and graphs.padded_runs >= 2 and graphs.eager_items == 0
        llm.shutdown()
    assert got[False] == got[True] == want
