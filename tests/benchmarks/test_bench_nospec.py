"""`bench latency --backend pressroom,pressroom-nospec`: speculation and plain decoding of one workload in one
run, the speedup between them, and acceptance per position for the speculative one only."""
from __future__ import annotations

import json

from pressroom.entrypoints import cli


def test_speculative_and_plain_runs_share_one_report(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "latency.json"
    code = cli.main(["bench", "latency", "--model", tiny_model_dir("llama"), "--backend", "pressroom,pressroom-nospec",
                     "--batch-size", "1", "--input-len", "8", "--output-len", "12", "--ignore-eos", "--num-iters", "1",
                     "--num-iters-warmup", "0", "--dtype", "float32", "--kv-cache-memory-gib", "0.05",
                     "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
                     "--output-json", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    spec, plain = report["results"]
    assert (spec["backend"], plain["backend"]) == ("pressroom", "pressroom-nospec")
    assert spec["spec_decode"]["method"] == "ngram" and len(spec["spec_decode"]["acceptance_rate_per_pos"]) in (0, 3)
    assert "spec_decode" not in plain
    ratio = spec["output_tokens_per_s"] / plain["output_tokens_per_s"]
    assert abs(report["ratios"]["pressroom/pressroom-nospec"] - ratio) < 0.01
    assert "pressroom/pressroom-nospec" in capsys.readouterr().out


def test_latency_gives_each_iteration_its_own_dataset_batch(tiny_model_dir, tmp_path):
    from argparse import Namespace

    from pressroom.benchmarks.bench import latency_batches, latency_prompts
    args = Namespace(batch_size=2, num_iters=3, dataset_path="d.jsonl")
    assert latency_prompts(args) == 6
    assert latency_batches(args) == [[0, 1], [2, 3], [4, 5]]
    random_args = Namespace(batch_size=2, num_iters=3, dataset_path=None)
    assert latency_prompts(random_args) == 2 and latency_batches(random_args) == [[0, 1]] * 3
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in ("one two", "three four five", "six")))
    out = tmp_path / "latency.json"
    code = cli.main(["bench", "latency", "--model", tiny_model_dir("llama"), "--dataset-path", str(data),
                     "--batch-size", "1", "--output-len", "4", "--ignore-eos", "--num-iters", "3",
                     "--num-iters-warmup", "0", "--dtype", "float32", "--kv-cache-memory-gib", "0.05",
                     "--output-json", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    (result,) = report["results"]
    assert report["num_prompts"] == 3 and len(result["latencies_s"]) == 3 and result["batch_size"] == 1
