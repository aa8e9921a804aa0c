"""`pressroom train-drafter`'s pieces: recording the target's features along its own greedy output,
training that lowers the loss and lengthens held-out acceptance, and a saved drafter that serves."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import random_prompts
from transformers import AutoModelForCausalLM

from pressroom import LLM, SamplingParams
from pressroom.spec_decode.dflash2 import DFlash2Config, save_drafter
from pressroom.training.drafter import record, train


@pytest.mark.slow
def test_record_train_save_and_serve(tiny_model_dir, tmp_path):
    target = tiny_model_dir("llama")
    llm = LLM(target, dtype="float32", kv_cache_memory_gib=0.1, enable_prefix_caching=False)
    prompts = random_prompts(24, low=4, high=12, seed=51)
    seqs = record(llm, prompts, max_tokens=40, layers=(0, 1), batch=16, ignore_eos=True)
    assert all(s.features.shape == (len(s.tokens), 2 * 64) for s in seqs)
    # The features are the target's own: recording twice gives the same rows, equal to HF's hidden states.
    again = record(llm, prompts[:2], max_tokens=40, layers=(0, 1), ignore_eos=True)
    assert torch.allclose(again[0].features, seqs[0].features, rtol=1e-4, atol=1e-3)  # other batch, same rows
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    with torch.no_grad():
        states = hf(torch.tensor([seqs[0].tokens]), output_hidden_states=True).hidden_states
    assert torch.allclose(seqs[0].features[:, :64], states[1][0], atol=1e-3)  # layer 0's output

    cfg = DFlash2Config(block_size=4, target_layers=(0, 1), num_heads=2, conv_kernel_size=2, conv_group_size=16,
                        top_m=4, rank=8)
    drafter, report = train(llm.engine.model, seqs, cfg, steps=300, batch_size=32, progress=False, scorer_steps=100)
    assert report["first_loss"] > 10.0  # slots start near uniform logits: ln(49152) = 10.8
    assert report["last_loss"] < report["first_loss"] - 1.0
    assert report["scorer_last_loss"] < report["scorer_first_loss"]  # the selector learns the true paths
    # It fits what it saw; held-out acceptance is reported (a random tiny model's text does not generalise).
    assert report["train_after"]["argmax"] > report["train_before"]["argmax"] + 0.05
    assert report["train_after"]["selector"] >= report["train_after"]["argmax"] - 0.05
    assert report["held_out_examples"] > 0 and "selector" in report["held_out_after"]

    path = str(tmp_path / "drafter")
    save_drafter(drafter, path)
    spec = LLM(target, dtype="float32", kv_cache_memory_gib=0.1,
               speculative_config={"method": "dflash2", "model": path, "num_speculative_tokens": 4,
                                   "adaptive_token_budget": False})
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    seen = prompts[:8]  # continuations it trained on, so some drafts are accepted
    plain = llm.generate([{"prompt_token_ids": p} for p in seen], params, use_tqdm=False)
    outs = spec.generate([{"prompt_token_ids": p} for p in seen], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    stats = spec.engine.stats().spec
    assert stats.num_accepted_tokens > 0


def test_record_refuses_settings_that_would_miss_positions(tiny_model_dir):
    target = tiny_model_dir("llama")
    for settings, reason in (({"enable_prefix_caching": True}, "prefix_caching"),
                             ({"enable_prefix_caching": False, "async_scheduling": True}, "async_scheduling")):
        llm = LLM(target, dtype="float32", kv_cache_memory_gib=0.05, **settings)
        with pytest.raises(ValueError, match=reason):
            record(llm, [[1, 2, 3]], max_tokens=4, layers=(0,))


@pytest.fixture(scope="module")
def tiny_recording(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama"), dtype="float32", kv_cache_memory_gib=0.05, enable_prefix_caching=False)
    return llm, record(llm, random_prompts(12, low=4, high=10, seed=52), max_tokens=24, layers=(0, 1),
                       ignore_eos=True)


_SMALL = DFlash2Config(block_size=4, target_layers=(0, 1), num_heads=2, conv_kernel_size=2, conv_group_size=16,
                       top_m=4, rank=8)


def test_a_paused_run_resumes_to_the_weights_of_an_unbroken_one(tiny_recording, tmp_path):
    """A run checkpointed at its deadline and run again from its work directory ends with the very weights
    (and report) of a run that was never stopped: optimizer, schedule and sampling state all come back."""
    from pressroom.training.drafter import Schedule, TrainingPaused
    llm, seqs = tiny_recording

    def run(**kw):
        schedule = Schedule(12, 4, batch_size=16, checkpoint_every=5, **kw)
        return train(llm.engine.model, seqs, _SMALL, 12, held_out=0.2, progress=False, schedule=schedule)

    unbroken, report = run()
    with pytest.raises(TrainingPaused, match="drafter phase at step 1 of 12"):
        run(work_dir=str(tmp_path), deadline=0.0)  # already past: checkpoints after one step and stops
    resumed, again = run(work_dir=str(tmp_path))
    assert again["steps_run"] == 12 and again["scorer_steps_run"] == 4
    for (name, a), b in zip(unbroken.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
    assert again == report
    other = replace(_SMALL, rank=4)
    with pytest.raises(ValueError, match="another drafter configuration"):
        train(llm.engine.model, seqs, other, 12, held_out=0.2, progress=False,
              schedule=Schedule(12, 4, work_dir=str(tmp_path)))


def test_validation_that_stops_improving_ends_the_phase_early(tiny_recording):
    """With the learning rate at zero nothing improves: after `patience` flat measurements the phase stops,
    long before its steps are spent; the validation split is kept out of training."""
    from pressroom.training.drafter import Schedule
    llm, seqs = tiny_recording
    schedule = Schedule(200, 0, batch_size=8, lr=0.0, validation=0.25, eval_every=2, patience=2)
    _, report = train(llm.engine.model, seqs, _SMALL, 200, held_out=0.2, progress=False, schedule=schedule)
    assert report["stopped_early"] and report["steps_run"] == 6  # the first measurement, then two flat ones
    assert report["best_step"] == 2 and report["validation_examples"] > 0


def test_the_cli_pauses_at_its_time_limit_and_resumes_from_the_work_dir(tiny_model_dir, tmp_path, monkeypatch):
    """Out of time: exit 75 and nothing lost; the same command finishes with a drafter that loads; recorded
    continuations are kept in the work directory, so a later call does not generate them again."""
    import json

    from pressroom.entrypoints.cli import main
    from pressroom.spec_decode.dflash2 import load_drafter
    from pressroom.training import drafter as train_module
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"Count with me: {i} {i + 1}"}) for i in range(6)))
    work, out = tmp_path / "work", tmp_path / "drafter"
    argv = ["train-drafter", "--model", tiny_model_dir("llama"), "--dtype", "float32", "--dataset-path", str(data),
            "--output", str(out), "--max-tokens", "8", "--steps", "4", "--draft-block-size", "4", "--num-heads", "2",
            "--kv-cache-memory-gib", "0.05", "--record-batch", "3", "--work-dir", str(work)]
    assert main([*argv, "--time-limit", "1e-9"]) == 75
    assert not out.exists()
    assert main(argv) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["steps"] == 4 and report["train_examples"] > 0
    assert load_drafter(str(out)).cfg.block_size == 4
    assert sorted(p.name for p in work.glob("train-*.pt")) == ["train-00000.pt", "train-00001.pt"]

    def no_generation(*args, **kwargs):
        raise AssertionError("continuations are in the work dir")

    monkeypatch.setattr(train_module, "generate", no_generation)
    (work / "train_state.pt").unlink()  # train again from the kept recording
    assert main(argv) == 0
