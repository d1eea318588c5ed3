"""Model backbones: small open_clip ViTs with ViT-B/32's parameter names, and local-file loaders.

The open_clip names are re-exported lazily (PEP 562): importing ``mergecal.backbones.hf_text``, or validating
params.yaml, does not pay for importing open_clip (torchvision, transformers: seconds in every DVC stage).
"""

__all__ = ["ARCHITECTURES", "create_clip", "get_tokenizer", "image_features", "image_size", "load_clip",
           "load_pretrained_file", "logits", "preprocess", "register_architectures", "save_clip", "zero_shot_head"]


def __getattr__(name: str):
    if name in __all__:
        from . import open_clip_vit

        return getattr(open_clip_vit, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
