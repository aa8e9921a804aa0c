"""vLLM 0.32's `vllm serve` flags that pressroom once refused, working as in vLLM: HTTPS (--ssl-*), --root-path,
--config FILE.yaml (and flag names with underscores), --generation-config / --override-generation-config, and
--help=all / --help=GROUP / --help=WORD. One real server (HTTPS, a path prefix, a YAML config, the model's
generation_config.json) is called with the official openai client."""
from __future__ import annotations

import argparse
import json
import shutil
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pressroom.engine.sampling_defaults import SamplingDefaults, load_sampling_defaults
from pressroom.entrypoints import cli
from pressroom.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from pressroom.entrypoints.openai.server import route_path
from pressroom.entrypoints.openai.settings import ServerSettings
from pressroom.entrypoints.openai.tls import TLSSettings

NOW_HONOURED = ("--ssl-keyfile", "--ssl-certfile", "--ssl-ca-certs", "--ssl-cert-reqs", "--ssl-ciphers",
                "--enable-ssl-refresh", "--root-path", "--config", "--generation-config",
                "--override-generation-config")


def _parse(*argv: str) -> argparse.Namespace:
    return cli.build_parser().parse_args(["serve", *argv])


def _parse_error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as ended:
        cli.build_parser().parse_args(argv)
    assert ended.value.code == 2
    return capsys.readouterr().err


def test_these_flags_are_no_longer_refused():
    assert not any(name in names for names in cli.REFUSED_FLAGS for name in NOW_HONOURED)
    serve = next(a for a in cli.build_parser()._actions if a.choices and "serve" in a.choices).choices["serve"]
    for name in NOW_HONOURED[:-3] + NOW_HONOURED[-2:]:  # --config is read before parsing, not a flag
        assert not isinstance(serve._option_string_actions[name], cli.RefusedFlag), name


# ---- --config FILE.yaml and underscores ----

def _yaml(tmp_path: Path, text: str, name: str = "config.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_config_file_sets_flags_and_the_command_line_wins(tmp_path):
    config = _yaml(tmp_path, "port: 9001\nmax_model_len: 4k\nserved-model-name: [a, b]\nenable_prefix_caching: false\n"
                             "trust-remote-code: true\nhf_overrides: {rope_theta: 5}\nhost: null\n")
    ns = _parse("MODEL", "--config", config, "--port", "9002")
    assert (ns.model_tag, ns.port, ns.max_model_len, ns.served_model_name) == ("MODEL", 9002, 4000, ["a", "b"])
    assert ns.enable_prefix_caching is False and ns.trust_remote_code is True
    assert json.loads(ns.hf_overrides) == {"rope_theta": 5}
    assert ns.host == ServerSettings().host  # null: the default
    assert _parse(f"--config={config}").port == 9001  # the = form too
    late = _parse("--port", "9003", "--config", config, "MODEL")  # MODEL after a list the file gives
    assert (late.model_tag, late.served_model_name, late.port) == ("MODEL", ["a", "b"], 9003)


def test_config_model_and_the_command_lines_model(tmp_path):
    config = _yaml(tmp_path, "model: from/config\n")
    assert _parse("--config", config).model == "from/config"
    ns = _parse("from/cli", "--config", config)  # the positional MODEL wins, as in vLLM
    assert (ns.model_tag, ns.model) == ("from/cli", None)


@pytest.mark.parametrize("name,text,says", [
    ("config.json", "{}", "a YAML file (.yaml or .yml)"),
    ("config.yaml", "- port\n", "a mapping of flag names to values"),
    ("config.yaml", "port: [1\n", "not YAML"),
    ("config.yaml", "no_such_flag: 1\n", "--config: 'no_such_flag' is not a flag of `pressroom serve`"),
    ("config.yaml", "port: eighty\n", "argument --port: invalid int value: 'eighty'"),
])
def test_bad_config_files_are_errors(tmp_path, capsys, name, text, says):
    assert says in _parse_error(["serve", "--config", _yaml(tmp_path, text, name)], capsys)


def test_missing_or_repeated_config(tmp_path, capsys):
    assert "No such file" in _parse_error(["serve", "--config", str(tmp_path / "none.yaml")], capsys)
    config = _yaml(tmp_path, "port: 1\n")
    assert "given 2 times" in _parse_error(["serve", "--config", config, "--config", config], capsys)


def test_flag_names_take_underscores():
    ns = _parse("--max_model_len", "2k", "--served_model_name", "x", "--ssl_cert_reqs=0")
    assert (ns.max_model_len, ns.served_model_name, ns.ssl_cert_reqs) == (2000, ["x"], 0)
    assert ns.model_tag is None


# ---- --help=all, --help=GROUP, --help=WORD ----

def _help(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as ended:
        cli.build_parser().parse_args(["serve", *argv])
    assert ended.value.code == 0
    return capsys.readouterr().out


def test_help_all_group_and_word(capsys):
    everything = _help(capsys, "--help=all")
    assert everything == _help(capsys, "--help") and "--ssl-certfile" in everything and "--max-model-len" in everything
    model = _help(capsys, "--help=ModelConfig")  # vLLM's group names, any case
    assert model.startswith("ModelConfig:") and "--max-model-len" in model and "--port" not in model
    assert "--block-size" in _help(capsys, "--help=cacheconfig")
    frontend = _help(capsys, "--help=Frontend")
    assert "--root-path" in frontend and "--api-key" in frontend and "--max-model-len" not in frontend
    https = _help(capsys, "--help=https")  # pressroom's own group, by its title's first word
    assert "--ssl-keyfile" in https and "--enable-ssl-refresh" in https and "--port" not in https
    ssl_flags = _help(capsys, "--help=ssl")  # a word: the flags whose names hold it
    assert "flags matching 'ssl'" in ssl_flags and "--ssl-ca-certs" in ssl_flags and "--root-path" not in ssl_flags
    assert "No group or flags matching 'zzz'" in _help(capsys, "--help=zzz")


# ---- settings: bad values are errors before anything loads ----

@pytest.mark.parametrize("argv,says", [
    (["--root-path", "llm"], "--root-path 'llm': a path that starts with /"),
    (["--ssl-keyfile", "k.pem"], "--ssl-keyfile needs --ssl-certfile"),
    (["--ssl-certfile", "c.pem", "--ssl-cert-reqs", "2"], "give --ssl-ca-certs"),
    (["--ssl-certfile", "c.pem", "--ssl-cert-reqs", "5"], "--ssl-cert-reqs 5: one of 0 .none., 1"),
    (["--generation-config", "/no/such/folder"], "--generation-config '/no/such/folder': not a folder"),
    (["--override-generation-config", "[1]"], "--override-generation-config"),
])
def test_bad_settings_are_value_errors(argv, says):
    with pytest.raises(ValueError, match=says):
        ServerSettings.from_args(_parse(*argv))


def test_generation_flags_reach_the_settings(tmp_path):
    settings = ServerSettings.from_args(_parse("--generation-config", str(tmp_path), "--override-generation-config",
                                               '{"temperature": 0.1}'))
    assert (settings.generation_config, settings.override_generation_config) == (str(tmp_path), {"temperature": 0.1})
    assert ServerSettings.from_args(_parse()).generation_config == "auto"  # vLLM's default: the model's own


def test_root_path_is_normalized_and_route_path_strips_it():
    assert ServerSettings.from_args(_parse("--root-path", "/llm/")).root_path == "/llm"
    assert ServerSettings.from_args(_parse("--root-path", "/")).root_path == ""
    scope = {"path": "/llm/v1/models", "root_path": "/llm"}
    assert route_path(scope) == "/v1/models"
    assert route_path(scope | {"path": "/v1/models"}) == "/v1/models"  # a proxy that strips the prefix
    assert route_path(scope | {"path": "/llmx/v1"}) == "/llmx/v1"  # not the prefix: a longer name


def _make_cert(folder: Path, name: str) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 and localhost, and its key (openssl's command line)."""
    cert, key = folder / f"{name}.crt", folder / f"{name}.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-days", "2", "-subj", "/CN=localhost", "-keyout", str(key), "-out", str(cert),
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"], check=True, capture_output=True)
    return str(cert), str(key)


needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None, reason="the openssl command makes the "
                                                                            "certificates")


@needs_openssl
def test_tls_check_names_the_bad_file(tmp_path):
    cert, key = _make_cert(tmp_path, "a")
    TLSSettings(certfile=cert, keyfile=key).check()
    with pytest.raises(ValueError, match="--ssl-keyfile .*no such file"):
        TLSSettings(certfile=cert, keyfile=str(tmp_path / "none.key")).check()
    with pytest.raises(ValueError, match="not a certificate and its private key"):
        TLSSettings(certfile=key, keyfile=key).check()
    _, other_key = _make_cert(tmp_path, "b")
    with pytest.raises(ValueError, match="not a certificate and its private key"):
        TLSSettings(certfile=cert, keyfile=other_key).check()  # a key that is not the certificate's


# ---- the generation config's defaults ----

def _generation_folder(folder: Path, **values) -> str:
    from transformers import GenerationConfig
    GenerationConfig(**values).save_pretrained(str(folder))
    return str(folder)


def test_generation_config_values_as_vllm_takes_them(tmp_path):
    model = _generation_folder(tmp_path, do_sample=True, temperature=0.6, top_k=20, top_p=0.95, max_new_tokens=64,
                               repetition_penalty=1.1, bos_token_id=1)
    auto = load_sampling_defaults("auto", None, model)
    assert auto == SamplingDefaults({"repetition_penalty": 1.1, "temperature": 0.6, "top_k": 20, "top_p": 0.95,
                                     "max_tokens": 64}, None, "model")
    assert load_sampling_defaults("vllm", None, model) == SamplingDefaults()
    assert load_sampling_defaults("auto", None, str(tmp_path / "model.gguf")) == SamplingDefaults({}, None, "model")
    # a folder: its max_new_tokens caps every request; --override-generation-config over the file's values
    folder = load_sampling_defaults(model, {"temperature": 0.2, "min_p": 0.05}, "/elsewhere")
    assert folder.values["temperature"] == 0.2 and folder.values["min_p"] == 0.05 and folder.max_tokens_cap == 64
    override_cap = load_sampling_defaults("vllm", {"max_new_tokens": 9}, model)
    assert override_cap == SamplingDefaults({"max_tokens": 9}, 9, "vllm")


def test_defaults_fill_what_a_request_leaves_out():
    defaults = SamplingDefaults({"repetition_penalty": 1.1, "temperature": 0.6, "top_k": 20, "top_p": 0.95,
                                 "min_p": 0.05, "max_tokens": 64}, None, "model")
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], temperature=0.3, top_k=0)
    params = defaults.fill(chat).to_sampling_params(defaults.max_tokens(chat.requested_max_tokens, 1000))
    assert (params.temperature, params.top_k) == (0.3, 0)  # the request's own, even at the API's neutral values
    assert (params.top_p, params.min_p, params.repetition_penalty, params.max_tokens) == (0.95, 0.05, 1.1, 64)
    neutral = chat.to_sampling_params(None)
    assert (neutral.top_p, neutral.min_p, neutral.repetition_penalty) == (1.0, 0.0, 1.0)  # without: the API's
    completion = CompletionRequest(prompt="hi")  # max_tokens 16 unless given, as vLLM's
    assert defaults.fill(completion).to_sampling_params(16).temperature == 0.6
    assert defaults.max_tokens(None, 10) == 10  # within the context the prompt leaves
    assert defaults.max_tokens(100, 1000) == 100  # a request's own, above the default: no cap from auto
    capped = SamplingDefaults({"max_tokens": 64}, 64, "/folder")
    assert (capped.max_tokens(100, 1000), capped.max_tokens(None, 30)) == (64, 30)
    assert SamplingDefaults().max_tokens(None, 1000) is None  # none: to the context's end, as before


# ---- one real server: HTTPS, a path prefix, a YAML config, the model's generation_config.json ----

ROOT = "/llm"


@pytest.fixture(scope="module")
def https_server(tmp_path_factory, tiny_model_dir):
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command makes the certificates")
    from serving import _die_with_test_run, free_port, tail
    folder = tmp_path_factory.mktemp("https")
    model = folder / "model"
    shutil.copytree(tiny_model_dir("llama"), model)
    (model / "generation_config.json").unlink(missing_ok=True)
    _generation_folder(model, do_sample=True, temperature=0.7, top_k=1, max_new_tokens=5)
    cert, key = _make_cert(folder, "server")
    port = free_port()
    config = _yaml(folder, f"port: {port}\nssl_certfile: {cert}\nssl-keyfile: {key}\nroot_path: {ROOT}\n"
                           "enable-ssl-refresh: true\nserved-model-name: [tiny]\ndtype: float32\n"
                           "kv_cache_memory_gib: 0.05\n")
    log_path = folder / "server.log"
    with open(log_path, "w+") as log:
        proc = subprocess.Popen([sys.executable, "-m", "pressroom.entrypoints.cli", "serve", str(model),
                                 "--config", config], stdout=log, stderr=subprocess.STDOUT,
                                preexec_fn=_die_with_test_run)
        url = f"https://127.0.0.1:{port}"
        trusted = ssl.create_default_context(cafile=cert)
        try:
            deadline = time.monotonic() + 180
            while True:
                assert proc.poll() is None, tail(log)
                assert time.monotonic() < deadline, tail(log)
                try:
                    if httpx.get(f"{url}{ROOT}/health", verify=trusted, timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.3)
            yield url, trusted, folder, log
            assert proc.poll() is None and "Traceback" not in tail(log), tail(log)
        finally:
            proc.kill()
            proc.wait()


def test_openai_client_over_https_behind_a_prefix(https_server):
    import openai
    url, trusted, _, log = https_server
    with httpx.Client(verify=trusted) as http:
        client = openai.OpenAI(base_url=f"{url}{ROOT}/v1", api_key="none", http_client=http)
        assert [m.id for m in client.models.list()] == ["tiny"]
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello"}],
                                              logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
        # no max_tokens: the model's max_new_tokens (5); no temperature or top_k: its top_k 1, so greedy
        assert chat.usage.completion_tokens == 5 and chat.choices[0].finish_reason == "length"
        assert all(t.token == t.top_logprobs[0].token for t in chat.choices[0].logprobs.content)
        longer = client.completions.create(model="tiny", prompt="Hello", max_tokens=7, extra_body={"ignore_eos": True})
        assert longer.usage.completion_tokens == 7  # a request's own max_tokens: auto does not cap it
        # a proxy that strips the prefix reaches the same routes; the schema names the prefix
        assert http.get(f"{url}/v1/models").json()["data"][0]["id"] == "tiny"
        assert http.get(f"{url}{ROOT}/openapi.json").json()["servers"] == [{"url": ROOT}]
    with pytest.raises(httpx.HTTPError):  # plain HTTP is not served
        httpx.get(f"http://127.0.0.1:{url.rsplit(':', 1)[1]}{ROOT}/health", timeout=5)
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):  # nor a certificate not trusted
        httpx.get(f"{url}{ROOT}/health", verify=ssl.create_default_context(), timeout=5)
    from serving import tail
    text = tail(log)
    assert f"serving tiny on {url}{ROOT}" in text and " ready in " in text  # the app's start-up ran too
    assert "Using default chat sampling params from model: {'temperature': 0.7, 'top_k': 1, 'max_tokens': 5}" in text


def test_certificate_files_are_reloaded(https_server):
    url, _, folder, log = https_server
    new_cert, new_key = _make_cert(folder, "renewed")
    shutil.copyfile(new_key, folder / "server.key")
    shutil.copyfile(new_cert, folder / "server.crt")
    renewed = ssl.create_default_context(cafile=new_cert)
    deadline = time.monotonic() + 10
    while True:
        try:
            assert httpx.get(f"{url}{ROOT}/health", verify=renewed, timeout=2).status_code == 200
            break
        except httpx.ConnectError:
            assert time.monotonic() < deadline, "the renewed certificate was not served"
            time.sleep(0.3)
    from serving import tail
    assert "reloaded the TLS certificate" in tail(log)
