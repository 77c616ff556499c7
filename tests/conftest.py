"""Shared fixtures: tiny random-init models built in code, offline and deterministic."""

from __future__ import annotations

import os

# OpenMP threads that busy-wait make every op crawl on a shared 2-core machine; this must be
# set before torch loads its OpenMP runtime.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
import torch
from tiny_models import tiny_llama, tiny_qwen2

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault(
    "DRAFTSMITH_THREADS", "1"
)  # what commands run here use (draftsmith.decode.cpu_threads)
# Tiny models are dominated by per-op overhead; one thread is faster and deterministic, and
# on a shared 2-core machine more threads only fight each other.
torch.set_num_threads(1)


@pytest.fixture(autouse=True, scope="session")
def _user_cache(tmp_path_factory: pytest.TempPathFactory):
    """Demo targets built by preset name and cached regenerated rows go to a folder of this
    session, never the user's own cache."""
    patch = pytest.MonkeyPatch()
    patch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("user-cache")))
    yield
    patch.undo()


@pytest.fixture
def llama_target() -> torch.nn.Module:
    return tiny_llama(seed=0)


@pytest.fixture
def llama_draft() -> torch.nn.Module:
    return tiny_llama(num_layers=1, seed=1)


@pytest.fixture
def qwen_target() -> torch.nn.Module:
    return tiny_qwen2(seed=2)


@pytest.fixture
def qwen_draft() -> torch.nn.Module:
    return tiny_qwen2(num_layers=1, seed=3)


@pytest.fixture(scope="session")
def tiny_pair_dirs(tmp_path_factory: pytest.TempPathFactory):
    """Saved tiny target and draft folders (shared tokenizer), built once per session."""
    from tiny_models import save_tiny_pair

    return save_tiny_pair(tmp_path_factory.mktemp("tiny_pair"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """GPU tests skip cleanly on machines without CUDA."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def llama31_target(tmp_path_factory: pytest.TempPathFactory):
    """Llama-3.1-8B-Instruct's config, vocabulary, rope and chat template on a 4 x 64 model."""
    from real_targets import LLAMA31, save_scaled_target

    return save_scaled_target(LLAMA31, tmp_path_factory.mktemp("llama31") / "target")


@pytest.fixture(scope="session")
def qwen3_target(tmp_path_factory: pytest.TempPathFactory):
    """Qwen3-8B's config, vocabulary, rope and chat template on a 4 x 64 model."""
    from real_targets import QWEN3, save_scaled_target

    return save_scaled_target(QWEN3, tmp_path_factory.mktemp("qwen3") / "target")
