"""Shared fixtures: tiny models and data, and the `cuda` marker's skip."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from torch import nn

os.environ.setdefault("PYTHONHASHSEED", "0")
warnings.filterwarnings("ignore", message=".*does not have many workers.*")
warnings.filterwarnings("ignore", message=".*GPU available but not used.*")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


# Process-wide variables Lightning writes into ``os.environ`` that a process started later inherits
_DISTRIBUTED_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE")
_SEED_ENV = ("PL_GLOBAL_SEED", "PL_SEED_WORKERS")  # L.seed_everything / LightningCLI's seed_everything


@pytest.fixture(autouse=True)
def _fresh_distributed_env():
    """Every test starts and ends without the variables Lightning leaves in ``os.environ``.

    - ``MASTER_PORT`` (and friends), written when Lightning launches processes: the next multi-process test would
      reuse the port while the previous store may still hold it (``EADDRINUSE``).
    - ``PL_GLOBAL_SEED`` / ``PL_SEED_WORKERS``, written by ``L.seed_everything``: every rank of a later DDP / FSDP
      fit inherits them and re-seeds at setup (Lightning's ``reset_seed``), so its LoRA adapters start from the
      seed's first draws, not from the state the test seeded (the 2-process NF4 QLoRA test's adapters differed
      from one process's by 1.41 relative after a ``seed_everything(0)`` test ran earlier in the same process).
    """
    keys = (*_DISTRIBUTED_ENV, *_SEED_ENV)
    saved = {key: os.environ.pop(key) for key in keys if key in os.environ}
    yield
    for key in keys:
        os.environ.pop(key, None)
    os.environ.update(saved)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


class TinyMLP(nn.Module):
    """Linear -> ReLU -> Linear -> ReLU -> Linear on 16 features, 4 classes."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, width)
        self.fc2 = nn.Linear(width, width)
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


class TinyConvNet(nn.Module):
    """Conv -> BN -> ReLU -> Conv -> ReLU -> pool -> Linear on (B, 1, 8, 8) images, 4 classes."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(2 * width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn1(self.conv1(x)))
        x = torch.relu(self.conv2(x))
        return self.head(self.pool(x).flatten(1))


class Block(nn.Module):
    """A residual Linear -> ReLU -> Linear block (what ``ActivationCheckpointing("Block")`` names)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, width)
        self.fc2 = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class TinyBlocks(nn.Module):
    """Linear 16 -> width, two residual ``Block``s, Linear width -> 4: every technique of the package applies."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.stem = nn.Linear(16, width)
        self.blocks = nn.Sequential(Block(width), Block(width))
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 16) -> (B, 4)
        return self.head(self.blocks(torch.relu(self.stem(x))))


@pytest.fixture
def tiny_mlp() -> TinyMLP:
    torch.manual_seed(0)
    return TinyMLP()


@pytest.fixture
def tiny_blocks() -> TinyBlocks:
    torch.manual_seed(0)
    return TinyBlocks()


@pytest.fixture
def tiny_convnet() -> TinyConvNet:
    torch.manual_seed(0)
    return TinyConvNet()


@pytest.fixture
def tiny_gpt():
    """A 2-layer CharGPT (n_embd 32, block 16): the smallest real transformer we ship."""
    from lightning_lowmem.demo.charlm import CharGPT, GPTConfig

    torch.manual_seed(0)
    return CharGPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16))


@pytest.fixture
def tiny_trainer_kwargs(tmp_path) -> dict:
    """Trainer arguments for fast CPU runs in a temporary directory."""
    return dict(
        accelerator="cpu",
        devices=1,
        default_root_dir=str(tmp_path),
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=False,
    )


@pytest.fixture(params=["gpt2", "llama", "bert", "t5"])
def hf_family(request) -> str:
    """Each Hugging Face family of the test zoo (``tests/hf_zoo.py``); skipped without ``transformers``."""
    pytest.importorskip("transformers")
    return request.param
