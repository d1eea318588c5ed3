from mergecal import offline

offline.apply()  # offline and quiet (mergecal/offline.py); tests never need a network

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(2)


def low_rank_plus_noise(m: int, n: int, rank: int, generator: torch.Generator, noise: float = 0.05) -> torch.Tensor:
    """A matrix shaped like a real task-vector slice: a few strong directions plus small noise."""
    decay = torch.linspace(1.0, 0.2, rank)
    U = torch.randn(m, rank, generator=generator)
    V = torch.randn(rank, n, generator=generator)
    return (U * decay) @ V / rank**0.5 + noise * torch.randn(m, n, generator=generator)


def make_model(seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    """A tiny ViT-like state dict: attention/MLP matrices, 1-D keys, a patch conv, an int buffer."""
    g = torch.Generator().manual_seed(seed)
    return {
        "visual.conv1.weight": scale * torch.randn(8, 3, 2, 2, generator=g),
        "visual.class_embedding": scale * torch.randn(8, generator=g),
        "visual.positional_embedding": scale * torch.randn(5, 8, generator=g),
        "visual.blocks.0.attn.in_proj_weight": scale * low_rank_plus_noise(24, 8, 4, g),
        "visual.blocks.0.attn.in_proj_bias": scale * torch.randn(24, generator=g),
        "visual.blocks.0.mlp.c_fc.weight": scale * low_rank_plus_noise(32, 8, 4, g),
        "visual.blocks.0.mlp.c_proj.weight": scale * low_rank_plus_noise(8, 32, 4, g),
        "visual.blocks.0.ln_1.weight": 1.0 + 0.1 * scale * torch.randn(8, generator=g),
        "text_projection": scale * torch.randn(8, 6, generator=g),
        "position_ids": torch.arange(5),
    }


@pytest.fixture
def pretrained():
    return make_model(0)


@pytest.fixture
def finetuned(pretrained):
    """Three fine-tuned models: pretrained + a small, distinct task vector each."""
    out = []
    for t in range(3):
        delta = make_model(100 + t, scale=0.05)
        out.append({k: (v + delta[k] if v.is_floating_point() else v.clone()) for k, v in pretrained.items()})
    return out


@pytest.fixture
def task_vectors(pretrained, finetuned):
    return [{k: ft[k] - pretrained[k] for k in pretrained if pretrained[k].is_floating_point()} for ft in finetuned]
