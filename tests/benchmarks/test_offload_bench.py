"""`pressroom bench offload` on a tiny model: one run of the three configurations (and the no-eviction ceiling),
the offload ones served from their tiers, and the saved report plotted without running."""
from __future__ import annotations

import json

import pytest

from pressroom.entrypoints.cli import main


@pytest.fixture(scope="module")
def report_path(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("offload-bench")
    path = tmp / "offload.json"
    rc = main(["bench", "offload", "--model", tiny_model_dir("llama"), "--dtype", "float32", "--device", "cpu",
               "--num-documents", "6", "--document-len", "96", "--num-requests", "30", "--output-len", "2",
               "--device-cache-tokens", "256", "--kv-offloading-disk-path", str(tmp / "kv"),
               "--configs", "none,cpu,cpu+disk,no-eviction", "--output-json", str(path)])
    assert rc == 0
    return path


def test_the_three_configurations_run_and_the_tiers_serve(report_path):
    report = json.loads(report_path.read_text())
    rows = {r["config"]: r for r in report["rows"]}
    assert list(rows) == ["none", "cpu", "cpu+disk", "no-eviction"]
    assert all(r["requests"] == 30 and r["output_tokens_per_s"] > 0 and r["mean_ttft_ms"] > 0 for r in rows.values())
    assert rows["cpu"]["tier_chunk_hits"]["0:cpu"] > 0
    assert rows["cpu+disk"]["tier_chunk_hits"]["1:fs"] > 0  # the CPU tier holds half the documents
    assert set(report["ratios"]) == {"cpu", "cpu+disk", "no-eviction"}


def test_no_eviction_keeps_every_document_on_the_device(report_path):
    rows = {r["config"]: r for r in json.loads(report_path.read_text())["rows"]}
    # 30 requests over at most 6 documents of 96 tokens: a repeat finds its whole document cached, unless it
    # was admitted beside the document's first request (4 in flight) before that one had computed it
    assert rows["no-eviction"]["prefix_cache_hit_tokens"] >= (30 - 6 - 3) * 96
    assert rows["no-eviction"]["prefix_cache_hit_tokens"] > rows["none"]["prefix_cache_hit_tokens"]
    assert "tier_chunk_hits" not in rows["no-eviction"]


def test_a_saved_report_is_plotted_without_running(report_path, tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib draws the plot; it is not among the test dependencies")
    png = tmp_path / "offload.png"
    assert main(["bench", "offload", "--from-json", str(report_path), "--plot", str(png)]) == 0
    assert png.stat().st_size > 0
