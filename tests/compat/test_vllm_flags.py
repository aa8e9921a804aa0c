"""vLLM 0.32's 60 most-used `vllm serve` flags (vllm_flags.py) on `pressroom serve`'s parser: each one is either
taken (the parsed arguments differ from the defaults: not silently dropped) or refused with an error naming the flag
and why. The slow peer suite (test_vllm_peer.py) checks that vLLM's own parser takes the same command lines."""
from __future__ import annotations

import pytest

from compat.vllm_flags import ACCEPTED_AS_ALREADY_DONE, FLAGS, NAMED_IN_ISSUE_46, NOT_YET_HANDLED, argv_of
from pressroom.entrypoints import cli


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> str:
    """What the flags point at: a chat template, a YAML config, a LoRA folder, PEM file names."""
    tmp = tmp_path_factory.mktemp("flags")
    (tmp / "template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    (tmp / "config.yaml").write_text("port: 9001\nmax_model_len: 2k\n")
    (tmp / "sql-lora").mkdir()
    for name in ("key.pem", "cert.pem"):
        (tmp / name).write_text("-----BEGIN PLACEHOLDER-----\n")
    return str(tmp)


def test_sixty_flags_of_which_the_issue_names_all():
    assert len(FLAGS) == 60 and len({flag[0] for flag in FLAGS}) == 60
    assert len(NAMED_IN_ISSUE_46) == 22


def _case(flag: tuple[str, ...]):
    if flag[0] in NOT_YET_HANDLED:
        return pytest.param(flag, marks=pytest.mark.xfail(reason="unrecognized: issue 46 item 2 still open"))
    return flag


@pytest.mark.parametrize("flag", [_case(flag) for flag in FLAGS], ids=lambda flag: flag[0])
def test_flag_is_taken_or_refused_by_name(flag, files, capsys):
    argv = ["serve", "MODEL", *argv_of(flag, files)]
    try:
        ns = cli.build_parser().parse_args(argv)
    except SystemExit as ended:
        err = capsys.readouterr().err
        assert ended.code == 2, err
        assert f"argument {flag[0]}" in err or f"/{flag[0]}" in err or f"{flag[0]}/" in err, err
        assert "refused: " in err, f"{flag[0]} is an error without a reason:\n{err}"
        return
    changed = cli.non_default_args(ns)
    changed.pop("model_tag", None)
    if flag[0] in ACCEPTED_AS_ALREADY_DONE:
        assert changed == {}, changed
    else:
        assert changed, f"{flag[0]} parsed but changed nothing: silently ignored"


def test_an_unknown_vllm_flag_is_an_error_naming_it(capsys):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "MODEL", "--no-such-vllm-flag", "1"])
    assert "--no-such-vllm-flag" in capsys.readouterr().err
