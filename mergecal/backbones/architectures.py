"""The project's own open_clip architectures, as plain configs (no open_clip import, so validating params.yaml
stays cheap); ``open_clip_vit.register_architectures`` registers them with open_clip."""

from __future__ import annotations

# Custom architectures: ViT-B/32's config schema, shrunk for 32x32 images and CPU training.
ARCHITECTURES: dict[str, dict] = {
    "mergecal-vit-tiny": {
        "embed_dim": 64,
        "vision_cfg": {"image_size": 32, "layers": 4, "width": 64, "head_width": 32, "patch_size": 4},
        "text_cfg": {"context_length": 32, "vocab_size": 49408, "width": 64, "heads": 2, "layers": 2},
    },
    # the default benchmark's backbone: tiny's layers and widths on 8x8 patches, so 16 image tokens instead of
    # 64: on CPU a fine-tuning step is 2.8-3.2x and evaluation 4.4-5.1x faster (evidence/scripts/perf_eval_speed.py)
    "mergecal-vit-tiny-p8": {
        "embed_dim": 64,
        "vision_cfg": {"image_size": 32, "layers": 4, "width": 64, "head_width": 32, "patch_size": 8},
        "text_cfg": {"context_length": 32, "vocab_size": 49408, "width": 64, "heads": 2, "layers": 2},
    },
    # a pilot's wider image tower (tiny-p8's text tower): 128 wide, 4 heads of 32
    "mergecal-vit-small-p8": {
        "embed_dim": 64,
        "vision_cfg": {"image_size": 32, "layers": 4, "width": 128, "head_width": 32, "patch_size": 8},
        "text_cfg": {"context_length": 32, "vocab_size": 49408, "width": 64, "heads": 2, "layers": 2},
    },
    # for unit tests only: builds and trains in well under a second per step
    "mergecal-vit-micro": {
        "embed_dim": 32,
        "vision_cfg": {"image_size": 32, "layers": 2, "width": 32, "head_width": 16, "patch_size": 8},
        "text_cfg": {"context_length": 32, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
    },
}
