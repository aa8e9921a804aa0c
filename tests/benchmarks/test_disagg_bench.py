"""`pressroom bench disagg` (issue 49's figure): its parts (the synthetic tokenizer, the engines' and the router's
command lines as pressroom's own parser reads them, a kv_port taken again, the ratios), and one end-to-end run on the
CPU at a tiny size: a colocated engine, then a prefill engine, a decode engine and the router, as real processes."""
from __future__ import annotations

import argparse
import json

import pytest

from pressroom.benchmarks import disagg
from pressroom.entrypoints.cli import build_parser, main


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    disagg.add_disagg_bench_args(parser)
    return parser.parse_args(list(argv))


def test_the_synthetic_tokenizer_gives_each_id_its_own_text(tmp_path):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(disagg.write_token_tokenizer(tmp_path, 300))
    assert len(tok) == 300
    ids = [7, 299, 42]
    assert tok.decode(ids) == "t7 t299 t42" and tok(tok.decode(ids), add_special_tokens=False)["input_ids"] == ids
    assert all(tok.decode([i]) for i in range(300))  # no id decodes to nothing: one streamed chunk per token


def test_every_engine_and_router_flag_exists():
    """The command lines the bench starts, read by `pressroom`'s own parser: a renamed flag fails here, not on a
    GPU machine."""
    args = _args("--model", "llama-3.1-8b", "--load-format", "dummy", "--dtype", "bfloat16",
                 "--serve-args=--enforce-eager")
    workload = disagg.workload_from_args(args, "cuda")
    assert workload.streams == 64 and workload.long_input_len == 4096
    transfer = disagg.transfer_config("kv_producer", 1 << 30)
    argv = disagg.engine_args(args, "/tmp/tok", workload, 24.0, transfer)
    ns = build_parser().parse_args([*argv, "--port", "8000"])
    assert ns.kv_cache_memory_gib == 24.0 and ns.max_num_seqs == 64 + 32 + 1 and ns.load_format == "dummy"
    assert json.loads(ns.kv_transfer_config)["kv_role"] == "kv_producer" and ns.enforce_eager
    router = build_parser().parse_args([*disagg.router_args("http://a:1", "http://b:2", 60), "--port", "8001"])
    assert router.prefill == ["http://a:1"] and router.decode == ["http://b:2"]


def test_a_clashed_kv_port_is_replaced():
    argv = ["serve", "m", "--kv-transfer-config", json.dumps(disagg.transfer_config("kv_consumer", 1 << 20)), "-x"]
    again = disagg.with_new_kv_port(argv)
    before, after = json.loads(argv[3]), json.loads(again[3])
    assert after["kv_port"] != before["kv_port"] and {**after, "kv_port": 0} == {**before, "kv_port": 0}
    assert again[:3] == argv[:3] and again[4:] == argv[4:]


def test_ratios():
    results = {"colocated": {"p99_itl_ms": 100.0, "p50_itl_ms": 10.0, "p99_tpot_ms": 20.0, "p99_long_ttft_ms": 50.0,
                             "output_tokens_per_s": 1000.0},
               "disagg": {"p99_itl_ms": 40.0, "p50_itl_ms": 10.0, "p99_tpot_ms": 10.0, "p99_long_ttft_ms": 60.0,
                          "output_tokens_per_s": 900.0}}
    r = disagg.ratios(results)
    assert r["p99_itl"] == 0.4 and r["output_tokens_per_s"] == 0.9 and r["p99_itl_at_most_half"] is True
    assert disagg.ratios({"colocated": results["colocated"]}) == {}


@pytest.mark.slow
def test_end_to_end_on_the_cpu(tiny_model_dir, tmp_path):
    """Slow (about a minute on a loaded 2-core machine): four servers start, two at a time. Both configurations
    stream every token asked of them, and the report holds the figures issue 49 names."""
    pytest.importorskip("nixl", reason="the NixlConnector's transport (pip install nixl)")
    out = tmp_path / "disagg.json"
    rc = main(["bench", "disagg", "--model", tiny_model_dir("llama"), "--dtype", "float32", "--device", "cpu",
               "--streams", "3", "--stream-input-len", "8", "--stream-output-len", "24", "--long-prompts", "2",
               "--long-input-len", "96", "--long-output-len", "3", "--long-rate", "4", "--kv-cache-gib", "0.1",
               "--kv-buffer-mib", "16", "--output-json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert set(report["results"]) == {"colocated", "disagg"}
    for config, r in report["results"].items():
        assert r["streams_ok"] == 3 and r["long_prompts_ok"] == 2, (config, r["errors"])
        assert r["stream_tokens_received"] == r["stream_tokens_asked"] == 3 * 24, config
        assert r["long_tokens_received"] == r["long_tokens_asked"] == 2 * 3, config
        assert r["itl_count"] > 0 and 0 <= r["p50_itl_ms"] <= r["p99_itl_ms"] <= r["max_itl_ms"], config
        assert r["p50_long_ttft_ms"] > 0 and r["output_tokens_per_s"] > 0, config
    decode = report["results"]["disagg"]["decode_engine"]  # it read every prompt's KV: only last tokens computed
    assert decode["prompt_tokens_local_compute"] == 3 + 2 and decode["kv_transfer_failed_reads_total"] == 0
    assert decode["prompt_tokens_external_kv_transfer"] == 3 * 8 + 2 * 96 - 5
    assert set(report["ratios"]) >= {"p99_itl", "output_tokens_per_s", "p99_itl_at_most_half"}
    assert report["kv_cache_gib"] == {"colocated": 0.1, "disagg_each": 0.05}
    assert (tmp_path / "disagg.logs" / "router.log").exists()  # every process's log beside the report


def test_a_failed_start_stops_every_process_it_started(tmp_path):
    """One process exits while starting (an unknown flag): `running` raises with its log, and the one started beside
    it (a router, up or not) is stopped too: nothing outlives the bench."""
    import subprocess
    mark = f"http://127.0.0.1:9/{tmp_path.name}"  # in the router's command line: pgrep finds it by this
    specs = {"router": disagg.router_args(mark, mark, 5), "broken": ["serve", "--no-such-flag"]}
    with pytest.raises(RuntimeError, match="broken exited while starting") as error:
        with disagg.running(specs, tmp_path, timeout_s=120):
            pass
    assert "--no-such-flag" in str(error.value)
    assert (tmp_path / "router.log").exists()
    assert subprocess.run(["pgrep", "-f", mark], capture_output=True).returncode == 1  # no such process left


@pytest.mark.parametrize("log, lost", [
    ("E1207 ... Socket Bind failed ...\nRuntimeError: Failed to bind metadata listener socket", True),  # NIXL
    ("ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', 1): address already in use", True),
    ("ERROR pressroom: port 1 on 127.0.0.1 is in use by another process: stop it, or choose another port", True),
    ("ValueError: kv_buffer_size 1 holds no chunk of 1536 bytes; raise it.", False),
])
def test_what_a_lost_port_looks_like(log, lost):
    """The three ways a start loses a port picked free (each seen in a real log); anything else is not retried."""
    assert disagg.lost_a_port(log) is lost
