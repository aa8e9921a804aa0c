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
