"""Shared fixtures: tiny random GGUF models (unit tests) and the real models, loaded once per session."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from tiny_gguf import write_tiny_gguf  # noqa: E402

from specdec.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig  # noqa: E402


_DEVICE = {"name": "cpu"}


def pytest_addoption(parser):
    parser.addoption("--device", default=os.environ.get("SPECDEC_TEST_DEVICE", "cpu"),
                     help="where the device-aware tests run their models (batch invariance, speculative == "
                          "plain): cpu (CI) or cuda[:N] on a GPU machine")


def pytest_configure(config):
    _DEVICE["name"] = config.getoption("--device")


def on_device() -> str:
    """The device the device-aware tests put their models and tensors on (`pytest --device`)."""
    return _DEVICE["name"]


def cpu_precision(precision: str) -> None:
    """Skip where a precision runs only on the CPU kernels and the tests run on a GPU."""
    if precision.startswith("int4") and on_device() != "cpu":
        pytest.skip(f"{precision} runs on the CPU kernel")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="session")
def tiny_qwen(tiny_dir) -> Path:
    return write_tiny_gguf(tiny_dir / "tiny-qwen2.gguf", arch="qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3(tiny_dir) -> Path:
    """Qwen3: per-head q/k norms, no biases, head_dim 32 over hidden 64 (so q|k|v is wider than a row)."""
    return write_tiny_gguf(tiny_dir / "tiny-qwen3.gguf", arch="qwen3", seed=2, head_dim=32, qk_scale=4.0)


@pytest.fixture(scope="session")
def tiny_smollm3(tiny_dir) -> Path:
    """SmolLM3: llama's layout, every 4th layer without rotary embeddings."""
    return write_tiny_gguf(tiny_dir / "tiny-smollm3.gguf", arch="smollm3", seed=6, num_layers=4, qk_scale=12.0)


@pytest.fixture(scope="session")
def tiny_olmo2(tiny_dir) -> Path:
    """OLMo 2: norms on attention's and the MLP's outputs, q/k norms over the whole projection."""
    return write_tiny_gguf(tiny_dir / "tiny-olmo2.gguf", arch="olmo2", seed=8, qk_scale=3.0)


@pytest.fixture(scope="session")
def tiny_llama(tiny_dir) -> Path:
    return write_tiny_gguf(tiny_dir / "tiny-llama.gguf", arch="llama", seed=1)


def engine_config(model: str, **overrides) -> EngineConfig:
    """An EngineConfig with small defaults suited to tests; overrides go to the right section."""
    sections = {"model": {"device": on_device(), "precision": "float32"}, "cache": {"target_cache_blocks": 256}, "scheduler": {}}
    owners = {"precision": "model", "max_model_len": "model", "device": "model", "block_size": "cache",
              "target_cache_blocks": "cache", "enable_prefix_caching": "cache", "kv_cache_dtype": "cache",
              "max_num_batched_tokens": "scheduler", "max_batch_size": "scheduler",
              "long_prefill_token_threshold": "scheduler", "max_queued_requests": "scheduler"}
    for k, v in overrides.items():
        sections[owners[k]][k] = v
    return EngineConfig(model=ModelConfig(model=model, **sections["model"]),
                        cache=CacheConfig(**sections["cache"]),
                        scheduler=SchedulerConfig(**sections["scheduler"]))


def expected_auto_precision(model: str) -> str:
    """What `precision: auto` should give a GGUF model on this machine, worked out independently of the
    engine: the fastest mode its `specdec kld` verdict accepts, else int4-a16; float32 without the kernel."""
    from specdec.models.loader import gguf_identity
    from specdec.quant import criterion, kernel
    if not kernel.available():
        return "float32"
    identity = gguf_identity(model)
    m = criterion.measurement_for(*identity) if identity else None
    passing = [mode for mode in criterion.CPU_MODES if m and mode in m.modes and m.meets(mode)]
    return max(passing, key=lambda mode: m.modes[mode].decode_tok_s or 0.0) if passing else "int4-a16"


@pytest.fixture(scope="session")
def qwen05_loaded():
    from specdec.models.loader import load_model
    return load_model("qwen2.5-coder-0.5b-instruct", progress=False)


@pytest.fixture(scope="session")
def smollm_loaded():
    from specdec.models.loader import load_model
    return load_model("smollm2-135m-instruct", progress=False)


@pytest.fixture(scope="session")
def qwen15_loaded():
    from specdec.models.loader import load_model
    return load_model("qwen2.5-coder-1.5b-instruct", progress=False)


@pytest.fixture(scope="session")
def tiny_kquant(tiny_dir) -> Path:
    """Q4_K and Q6_K matrices, as in the real Qwen files (the int4-a8 kernel's super-block path)."""
    return write_tiny_gguf(tiny_dir / "tiny-kquant.gguf", arch="qwen2", seed=2, hidden=256, intermediate=512,
                           kquants=True)
