"""`pressroom bench context` on the CPU with tiny random models: a Mamba (state, no KV) beside a Llama (KV, no
state), both timed at each context, with the bytes per step from the engines' own cache layouts."""
from __future__ import annotations

import json

import torch

from pressroom.entrypoints.cli import main


def test_bench_context_times_decode_steps_per_context(tiny_model_dir, tmp_path, capsys):
    import transformers
    torch.manual_seed(0)
    config = transformers.MambaConfig(vocab_size=1000, hidden_size=32, state_size=8, num_hidden_layers=2,
                                      conv_kernel=4, expand=2)
    mamba = tmp_path / "mamba"
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(mamba)
    out = tmp_path / "context.json"
    assert main(["bench", "context", "--device", "cpu", "--dtype", "float32", "--models",
                 f"{mamba},{tiny_model_dir('llama')}", "--contexts", "16,48", "--decode-steps", "3",
                 "--batch-sizes", "1,3", "--kv-cache-memory-gib", "0.02", "--output-json", str(out)]) == 0
    report = json.loads(out.read_text())
    linear, full = report["models"]
    assert [(r["batch"], r["context"]) for r in linear["rows"]] == [(1, 16), (1, 48), (3, 16), (3, 48)]
    assert linear["kv_bytes_per_token"] == 0
    assert linear["state_bytes_per_request"] == 2 * (64 * 3 + 64 * 8) * 4
    assert full["state_bytes_per_request"] == 0 and full["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4
    for row in linear["rows"] + full["rows"]:
        assert row["decode_step_ms"] > 0 and row["prefill_s"] > 0 and 0 < row["over_bound"]
    # more context, more KV bytes to read: only the full-attention model's bytes per step grow; a batch reads
    # every request's KV and state
    assert linear["rows"][0]["bytes_per_step"] == linear["rows"][1]["bytes_per_step"]
    assert full["rows"][1]["bytes_per_step"] - full["rows"][0]["bytes_per_step"] == 32 * full["kv_bytes_per_token"]
    assert linear["rows"][2]["bytes_per_step"] - linear["rows"][0]["bytes_per_step"] == \
        2 * linear["state_bytes_per_request"]
    assert full["rows"][3]["bytes_per_step"] - full["rows"][1]["bytes_per_step"] == 2 * 48 * full["kv_bytes_per_token"]
    assert set(full["growth"]) == {"16", "48", "16@3", "48@3"} and full["growth"]["16@3"] == 1.0
    assert set(json.loads(capsys.readouterr().out.strip().splitlines()[-1])) == {"mamba", full["model"].split("/")[-1]}


def test_a_models_hf_overrides_reach_its_engine(tiny_model_dir, capsys):
    """Keyed by the model's name: a limit lowered below the contexts asked for is refused by that engine."""
    llama = tiny_model_dir("llama")
    name = llama.rstrip("/").split("/")[-1]
    assert main(["bench", "context", "--device", "cpu", "--dtype", "float32", "--models", llama, "--contexts",
                 "16,48", "--decode-steps", "3", "--kv-cache-memory-gib", "0.02",
                 "--hf-overrides", json.dumps({name: {"max_position_embeddings": 40}})]) != 0
    assert "max_model_len 59 exceeds the model's limit of 40 tokens" in capsys.readouterr().err
