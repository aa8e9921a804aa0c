"""`pressroom bench spec` plumbing on the CPU: a tiny random Llama as target and drafter, two concurrencies,
two fixed K's and the adaptive budget. Nothing here is timed; the figures come from the H200 run."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pressroom.benchmarks import spec
from pressroom.entrypoints import cli

# The checkout's held-out chat prompts: not in the package, so dflash2 is given them explicitly.
HELD_OUT = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "chat_heldout.jsonl"
CONCURRENCY, K_VALUES = [1, 3], [1, 2]
VARIANTS = {"none", "K=1", "K=2", "adaptive"}
TINY_FLAGS = ["--device", "cpu", "--dtype", "float32", "--concurrency", "1,3", "--k-values", "1,2", "--max-k", "2",
              "--beat-max-k-at", "3", "--input-len", "8", "--output-len", "8", "--requests-per-slot", "2",
              "--min-requests", "2", "--warmup-output-len", "4",
              "--kv-cache-memory-gib", "0.05", "--acceptance-rates", "0.9,0.6", "--num-threads", "1"]


@pytest.fixture(scope="module")
def report(tiny_model_dir, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("bench-spec") / "result.json"
    model = tiny_model_dir("llama")
    drafter = tmp_path_factory.mktemp("draft-config")  # config only: the bench writes random weights for it
    shutil.copy(Path(model) / "config.json", drafter / "config.json")
    argv = ["bench", "spec", "--model", model, "--draft-model", str(drafter), *TINY_FLAGS, "--output-json", str(out)]
    assert cli.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["draft_weights"] == "random (dummy)" and report["complete"]
    draft_dir = report["engines"]["K=1"]["engine_args"]["speculative_config"]["model"]
    assert not Path(draft_dir).exists()  # the temporary checkpoint is removed after the run
    return report


def test_every_cell_is_there(report):
    assert set(report["engines"]) == VARIANTS  # no synchronous baseline on the CPU: none is synchronous already
    assert report["requests"] == {"1": 2, "3": 6}
    for c in CONCURRENCY:
        row = report["cells"][str(c)]
        assert set(row) == VARIANTS
        for name, cell in row.items():
            assert cell["concurrency"] == c and cell["num_requests"] == 2 * c, name
            assert cell["output_tokens"] == 2 * c * 8, name  # ignore_eos: every request runs to its length
            assert cell["output_tokens_per_s"] > 0 and cell["engine_steps"] > 0, name


def test_speculation_accepts_drafts_and_no_speculation_has_none(report):
    for c in CONCURRENCY:
        row = report["cells"][str(c)]
        for name in ("K=1", "K=2"):
            cell = row[name]
            assert cell["mean_acceptance_length"] > 1, (c, name)
            assert cell["draft_tokens_per_verify"] <= int(name[2:]), (c, name)
            assert cell["request_steps"] == cell["output_tokens"] - cell["num_accepted_tokens"]
            assert sum(cell["accepted_per_pos"]) == cell["num_accepted_tokens"]
        none = row["none"]
        for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "mean_acceptance_length",
                    "draft_tokens_per_verify", "draft_tokens_per_request_step", "accepted_per_pos"):
            assert none[key] is None, key
        assert none["request_steps"] == none["output_tokens"]  # one token per sampling event


def test_summary_compares_adaptive_with_every_baseline(report):
    for c in CONCURRENCY:
        s = report["summary"][str(c)]
        assert s["best_fixed"] in ("K=1", "K=2")
        assert set(s["fixed_over_none"]) == {"K=1", "K=2"}
        for key in ("adaptive_over_none", "adaptive_over_best_fixed", "adaptive_over_max_k"):
            assert s[key] > 0, (c, key)
        expected = {"adaptive >= none", "adaptive >= 0.95 x best fixed K"} | ({"adaptive > K=2"} if c == 3 else set())
        assert set(s["conditions"]) == expected
    assert isinstance(report["all_conditions_hold"], bool)


def test_request_counts_are_clamped():
    args = cli.build_parser().parse_args(["bench", "spec"])
    assert [spec.num_requests(c, args) for c in args.concurrency] == [4, 8, 32, 128, 512]


def test_expected_acceptance_length_follows_the_synthetic_rates(report):
    assert report["expected_acceptance_length"] == {"K=1": 1.9, "K=2": 2.44}  # 1 + 0.9, 1 + 0.9 + 0.9 * 0.6
    rates = [0.85, 0.75, 0.65, 0.55, 0.45, 0.35, 0.25]  # survivals .85 .6375 .4144 .2279 .1026 .0359 .0090
    assert spec.expected_acceptance_length(rates, 7) == 3.2772
    assert spec.expected_acceptance_length([0.5], 3) == 1.875  # the last rate repeats


@pytest.mark.slow  # the embedded target and its drafter through the whole bench (16 s in CI)
def test_dflash2_runs_the_real_target_and_drafter_on_chat_prompts(tmp_path):
    """`--method dflash2`: the embedded model with its committed drafter, real weights and acceptance, the
    dataset's prompts as chat turns (the CPU's measurement of the adaptive budget); `--rounds 2`: the engines
    side by side, taking turns, each cell its faster round."""
    out = tmp_path / "result.json"
    argv = ["bench", "spec", "--method", "dflash2", "--dataset-path", str(HELD_OUT), "--device", "cpu",
            "--concurrency", "1,2", "--k-values", "2",
            "--max-k", "4", "--output-len", "6", "--requests-per-slot", "1", "--min-requests", "2",
            "--warmup-output-len", "2", "--kv-cache-memory-gib", "0.1", "--rounds", "2", "--output-json", str(out)]
    assert cli.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["method"] == "dflash2" and report["acceptance_rates"] is None and report["complete"]
    assert report["rounds"] == 2 and report["engines"]["adaptive"]["adaptive_budget"] is not None
    assert set(report["engines"]) == {"none", "K=2", "adaptive"}
    config = report["engines"]["K=2"]["engine_args"]
    assert config["load_format"] == "auto" and config["speculative_config"]["method"] == "dflash2"
    for c in ("1", "2"):
        cell = report["cells"][c]["K=2"]
        assert cell["output_tokens"] == cell["num_requests"] * 6
        assert cell["num_drafts"] > 0 and 1 <= cell["mean_acceptance_length"] <= 3
    assert "adaptive >= none" in report["summary"]["1"]["conditions"]
