"""One server of the embedded model that several modules share (each start costs some 10 s on 2 cores)."""
from __future__ import annotations

import pytest
from serving import serve

SMOL_ARGS = ["serve", "--kv-cache-memory-gib", "0.25", "--served-model-name", "smol", "--max-num-seqs", "32",
             "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--trust-request-chat-template"]


@pytest.fixture(scope="session")
def smol_server(tmp_path_factory):
    """The embedded SmolLM2 served as "smol": 32 sequences, tool calls read by the hermes parser, chat templates
    taken from requests (the structured-output, tool-calling and chat-page tests)."""
    with serve(SMOL_ARGS, tmp_path_factory.mktemp("smol") / "server.log") as (url, _):
        yield url
