"""`pressroom train-drafter --method dspark`: a DSpark drafter trained on the target's recorded greedy output
lowers its loss, lengthens the acceptance greedy verification would see and calibrates its confidence head; saved in
DeepSpec's layout, it loads as `method: "dspark"` and serves the target's greedy tokens with drafts accepted."""
from __future__ import annotations

import json
import os

import pytest
from conftest import random_prompts

from pressroom import LLM, SamplingParams
from pressroom.training.drafter import Schedule, record
from pressroom.training.dspark import DSparkTrainConfig, save_drafter, train


@pytest.fixture(scope="module")
def recording(tiny_model_dir):
    target = tiny_model_dir("llama")
    llm = LLM(target, dtype="float32", kv_cache_memory_gib=0.05, enable_prefix_caching=False)
    prompts = random_prompts(16, low=4, high=10, seed=61)
    return target, llm, prompts, record(llm, prompts, max_tokens=24, layers=(0,), ignore_eos=True)


def test_a_short_run_lowers_the_loss_and_saves_what_loads(recording, tmp_path):
    """Forty steps, then the checkpoint in DeepSpec's layout read back by the proposer's loader: the same tensors,
    the target's embeddings and LM head left to the target."""
    import torch

    from pressroom.spec_decode.dspark import load_drafter
    _, llm, _, seqs = recording
    cfg = DSparkTrainConfig(block_size=4, target_layers=(0,), num_layers=1, markov_rank=8, context=16)
    drafter, report = train(llm.engine.model, seqs, cfg, Schedule(40, 0, batch_size=16), progress=False)
    assert report["last_loss"] < report["first_loss"]
    path = str(tmp_path / "dspark")
    save_drafter(drafter, llm.engine.model.config, path)
    loaded, shared = load_drafter(path)
    assert shared == {"embed_tokens.weight", "lm_head.weight"}
    mine = drafter.state_dict()
    for name, tensor in loaded.state_dict().items():
        if name not in shared:
            assert torch.equal(tensor, mine[name]), name


@pytest.mark.slow  # ~60 s quiet: 250 training steps, then a speculating engine
def test_train_save_load_and_serve(recording, tmp_path):
    target, llm, prompts, seqs = recording
    cfg = DSparkTrainConfig(block_size=4, target_layers=(0,), num_layers=1, markov_rank=8, context=32)
    drafter, report = train(llm.engine.model, seqs, cfg, Schedule(250, 0, batch_size=32, lr=3e-3), progress=False)
    assert report["last_loss"] < report["first_loss"] - 1.0
    # It fits what it saw (a random tiny model's text does not generalise); its confidences move toward what
    # survives (they start near 0.5 everywhere).
    assert report["train_after"]["argmax"] > report["train_before"]["argmax"] + 0.1
    assert report["train_after"]["confidence_error"] < report["train_before"]["confidence_error"] - 0.05

    path = str(tmp_path / "dspark")
    save_drafter(drafter, llm.engine.model.config, path)
    with open(os.path.join(path, "config.json")) as f:
        meta = json.load(f)
    assert meta["architectures"] == ["Qwen3DSparkModel"] and meta["target_layer_ids"] == [0]
    assert (meta["block_size"], meta["markov_rank"], meta["enable_confidence_head"]) == (4, 8, True)
    spec = LLM(target, dtype="float32", kv_cache_memory_gib=0.05,
               speculative_config={"method": "dspark", "model": path, "num_speculative_tokens": 4,
                                   "adaptive_token_budget": False})
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    seen = [{"prompt_token_ids": p} for p in prompts[:6]]  # continuations it trained on: drafts get accepted
    plain = llm.generate(seen, params, use_tqdm=False)
    outs = spec.generate(seen, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert spec.engine.stats().spec.num_accepted_tokens > 0
