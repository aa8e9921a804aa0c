"""`pressroom bench sparse-attention` on the CPU (tiny DeepSeek-V3.2 config): the plumbing the H200 run uses."""
from __future__ import annotations

import json

import pytest
from conftest import tiny_config

from pressroom.entrypoints.cli import main


@pytest.fixture(scope="module")
def tiny_dsa(tmp_path_factory):
    path = tmp_path_factory.mktemp("dsa")
    tiny_config("deepseek_v32").save_pretrained(path)
    return path


def test_the_report_times_both_layers_at_every_context(tiny_dsa, tmp_path, capsys):
    out = tmp_path / "sparse.json"
    assert main(["bench", "sparse-attention", "--model", str(tiny_dsa), "--device", "cpu", "--contexts", "48,160",
                 "--batch-size", "2", "--output-json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["context"] for r in report["rows"]] == [48, 160]
    assert report["index_topk"] == 32 and report["layers"] == tiny_config("deepseek_v32").num_hidden_layers
    for row in report["rows"]:
        assert row["dsa_layer_us"] > 0 and row["dense_layer_us"] > 0
        assert row["dsa_step_ms"] == pytest.approx(row["dsa_layer_us"] * report["layers"] / 1e3)
    assert report["dsa_growth"]["48"] == 1.0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["dsa_growth"] == report["dsa_growth"]


def test_a_bad_context_list_is_refused(tiny_dsa, capsys):
    with pytest.raises(SystemExit):
        main(["bench", "sparse-attention", "--model", str(tiny_dsa), "--device", "cpu", "--contexts", "0,x"])
    assert "expected positive integers" in capsys.readouterr().err


def test_a_saved_report_is_plotted_without_running(tiny_dsa, tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib draws the plot; it is not among the test dependencies")
    report = tmp_path / "sparse.json"
    assert main(["bench", "sparse-attention", "--model", str(tiny_dsa), "--device", "cpu", "--contexts", "48,96",
                 "--output-json", str(report)]) == 0
    png = tmp_path / "sparse.png"
    assert main(["bench", "sparse-attention", "--from-json", str(report), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
