"""The pretrained backbones are committed files (dvc.yaml: `cache: false` outputs of `pretrain` and `llm_pretrain`),
so nothing reruns the pretraining in a fresh clone: this test does, at smoke size (mergecal/pipeline/smoke_params.yaml,
the functions those stages call, the params' thread count), and compares the files with the sha256 digests in
tests/data/smoke_backbones.sha256 (`sha256sum -c` format, paths relative to a workspace's root). A change of the
pretraining code, of a library it uses or of the kernels changes them: check that it should, then write the new
digests (the assertion message lists them).

The digests are per CPU vendor: the kernels pinned to AVX2 (mergecal/offline.py) give the same bits on every AMD
machine seen (AVX2 and AVX-512), but an Intel Xeon (2026-11-28) trains other bits from the same code and the same
settings — both CLIP and the LLM base, deterministically run after run. `smoke_backbones.sha256` holds AMD's (where the
committed backbones were built), `smoke_backbones.<vendor_id>.sha256` another vendor's."""

import hashlib
from pathlib import Path

import pytest
import torch

from mergecal.pipeline.tracks.causal_lm.built import stages as llm
from mergecal.pipeline.tracks.clip.built import stages as vision
from mergecal.pipeline.config import parse_params
from mergecal.pipeline.threads import pin_threads
from mergecal.pipeline.workspace import smoke_overrides

DATA = Path(__file__).resolve().parent / "data"


def _vendor() -> str:
    """The CPU's vendor_id (GenuineIntel, AuthenticAMD, ...; "" where /proc/cpuinfo does not say)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("vendor_id")), "")


def _digests() -> Path:
    own = DATA / f"smoke_backbones.{_vendor()}.sha256"
    return own if own.exists() else DATA / "smoke_backbones.sha256"


DIGESTS = _digests()


def _pretrain_at_smoke_size(root: Path) -> list[Path]:
    """The files `pretrain` and `llm_pretrain` commit, built under ``root`` as the smoke workspace's stages do."""
    params = parse_params(smoke_overrides())
    before = torch.get_num_threads()
    try:
        pin_threads(params.threads)
        vision.build_data(params, root, progress=False)
        vision.pretrain(params, root, progress=False)
        llm.build_data(params, root)
        llm.pretrain(params, root, progress=False)
    finally:
        torch.set_num_threads(before)
    paths = vision.paths_for(params, root)
    base = llm.base_dir(params, root)
    return [paths.pretrained, paths.heads, paths.models / "pretrained.json",
            *sorted(p for p in base.rglob("*") if p.is_file())]


@pytest.mark.integration  # 12 s of CPU (one thread); 27 s on the shared 2-core machine
def test_pretraining_reproduces_the_committed_smoke_backbones(tmp_path):
    files = _pretrain_at_smoke_size(tmp_path)
    built = "".join(f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.relative_to(tmp_path).as_posix()}\n"
                    for p in files)
    assert built == DIGESTS.read_text(), f"the smoke-size pretraining now writes ({DIGESTS.name}):\n{built}"
