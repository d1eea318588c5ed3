"""A model architecture declared once (``mergecal.architecture_specs``): its FSC modules become a working architecture
(``feature_hooks.architecture_of``), its key roles reach ``keys.key_role`` (#41)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from mergecal.architecture_specs import ARCHITECTURE_SPECS, ROLES, ArchitectureSpec, FscModules
from mergecal.calibrations.fsc import calibrate_fsc
from mergecal.errors import ParameterError
from mergecal.feature_hooks import HOOKED_ARCHITECTURES, architecture_of
from mergecal.keys import key_role


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class ToyEncoder(nn.Module):
    """An architecture no module of mergecal knows: embeddings, blocks that may run sequence-first, a final norm."""

    def __init__(self, d: int = 8, layers: int = 2, seq_first: bool = False, final_norm: bool = True):
        super().__init__()
        self.embed = nn.Linear(4, d)
        self.layers = nn.ModuleList(Block(d) for _ in range(layers))
        self.batch_first = not seq_first
        self.final = nn.LayerNorm(d) if final_norm else nn.Identity()

    def forward(self, x):  # x: [N, L, 4]
        h = self.embed(x)
        h = h if self.batch_first else h.transpose(0, 1)
        for layer in self.layers:
            h = layer(h)
        h = h if self.batch_first else h.transpose(0, 1)
        return self.final(h)

    def encode(self, x):
        return self.forward(x).mean(1)


TOY = ArchitectureSpec(name="toy", description="a toy encoder",
                   fsc=FscModules(model_class=f"{__name__}:ToyEncoder", what="ToyEncoder", before=("embed",),
                                  blocks="layers", block=("norm", "up", "down"), after=("final",),
                                  optional=("final",), batch_first="batch_first", run_method="encode"))


def test_a_declared_family_hooks_its_modules_in_order_with_their_layout():
    architecture = architecture_of(TOY)
    wrapped = nn.Sequential(ToyEncoder())  # found anywhere in the model, its names qualified
    assert architecture.detect(wrapped)
    specs = architecture.fsc_modules(wrapped)
    assert [(s.name, s.granularity, s.batch_dim) for s in specs] == [
        ("0.embed", "token", 0),
        *[(f"0.layers.{i}.{m}", g, 0) for i in range(2) for m, g in (("norm", "scalar"), ("up", "token"),
                                                                    ("down", "token"))],
        ("0.final", "scalar", 0)]
    seq_first = architecture.fsc_modules(ToyEncoder(seq_first=True, final_norm=False))
    assert [s.batch_dim for s in seq_first] == [0] + [1] * 6  # the blocks only; no final norm (an Identity)
    assert seq_first[-1].name == "layers.1.down"
    x = torch.randn(3, 5, 4)
    model = ToyEncoder()
    assert torch.equal(architecture.run(model, x), model.encode(x))


def test_a_declared_family_runs_fsc_and_refuses_a_model_it_does_not_fit():
    torch.manual_seed(0)
    pre = ToyEncoder()
    fts = [ToyEncoder() for _ in range(2)]
    for ft in fts:
        ft.load_state_dict({k: v + 0.05 * torch.randn_like(v) for k, v in pre.state_dict().items()})
    data = [torch.randn(6, 5, 4) for _ in fts]
    copies = [copy.deepcopy(pre) for _ in range(4)]  # FSC hooks each model: four distinct ones
    same = calibrate_fsc(copies[0], copies[1], copies[2:], data, architecture=architecture_of(TOY), progress=False)
    assert same.ratios and all(abs(float(torch.as_tensor(r).mean()) - 1) < 1e-5 for r in same.ratios.values())
    averaged = copy.deepcopy(pre)  # the merge of two independent task vectors: shorter than either
    averaged.load_state_dict({k: (a + b) / 2 for (k, a), b in zip(fts[0].state_dict().items(),
                                                                    fts[1].state_dict().values())})
    merged = calibrate_fsc(averaged, pre, fts, data, architecture=architecture_of(TOY), progress=False)
    assert any(abs(float(torch.as_tensor(r).mean()) - 1) > 1e-3 for r in merged.ratios.values())
    assert set(merged.ratios) == {s.name for s in architecture_of(TOY).fsc_modules(pre)}
    with pytest.raises(ParameterError, match="toy: expected exactly one ToyEncoder in the model, found 2"):
        architecture_of(TOY).fsc_modules(nn.Sequential(ToyEncoder(), ToyEncoder()))
    broken = ToyEncoder()
    del broken.layers[0].up
    with pytest.raises(ParameterError, match="toy: expected module 'layers.0.up' is missing"):
        architecture_of(TOY).fsc_modules(broken)
    with pytest.raises(ParameterError, match="architecture spec declares no FSC modules"):
        architecture_of(ARCHITECTURE_SPECS["llama"])


def test_every_declared_family_with_fsc_modules_is_registered_and_its_roles_are_known():
    assert set(HOOKED_ARCHITECTURES) == {name for name, a in ARCHITECTURE_SPECS.items() if a.fsc is not None}
    for spec in ARCHITECTURE_SPECS.values():
        assert set(spec.key_roles) <= set(ROLES), spec.name
    # one key of each architecture and role, and an HF CLIP key judged by its open_clip name (the layout mapping)
    assert [key_role(k) for k in ("visual.positional_embedding", "visual.proj", "bert.pooler.dense.weight",
                                  "embeddings.word_embeddings.weight", "model.embed_tokens.weight",
                                  "visual_projection.weight", "vision_model.embeddings.position_embedding.weight",
                                  "visual.transformer.resblocks.0.mlp.c_fc.weight", "model.layers.0.mlp.up_proj.weight")
            ] == ["embedding", "projection", "projection", "embedding", "embedding", "projection", "embedding",
                  "other", "other"]
