"""Shared fixtures for the end-to-end tests: they start the real binaries built by cargo.

STRATA_BIN_DIR names the folder holding strata, strata-worker and strata-kvcache
(scripts/test sets it); STRATA_CACHE is where scripts/setup put the models.
"""
import os
import pathlib
import socket

import pytest


@pytest.fixture(scope="session")
def bin_dir() -> pathlib.Path:
    path = os.environ.get("STRATA_BIN_DIR")
    if not path:
        pytest.fail("STRATA_BIN_DIR is not set; run the tests through `make test`")
    path = pathlib.Path(path)
    for name in ("strata", "strata-worker", "strata-kvcache"):
        assert (path / name).is_file(), f"{path / name} missing: build with cargo first"
    return path


@pytest.fixture(scope="session")
def default_model() -> pathlib.Path:
    cache = pathlib.Path(os.environ.get("STRATA_CACHE", pathlib.Path.home() / ".cache/strata"))
    model = cache / "models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert model.is_file(), f"{model} missing: run scripts/setup"
    return model


@pytest.fixture(scope="session")
def minilm_model() -> pathlib.Path:
    cache = pathlib.Path(os.environ.get("STRATA_CACHE", pathlib.Path.home() / ".cache/strata"))
    model = cache / "models/all-minilm-l6-v2"
    assert (model / "model.safetensors").is_file(), f"{model} missing: run scripts/setup"
    return model


@pytest.fixture
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
