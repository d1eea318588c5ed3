"""Model backbones: small open_clip ViTs with ViT-B/32's parameter names, and local-file loaders."""

from .open_clip_vit import (ARCHITECTURES, create_clip, get_tokenizer, image_features, image_size, load_clip,
                            load_pretrained_file, logits, preprocess, register_architectures, save_clip,
                            zero_shot_head)

__all__ = ["ARCHITECTURES", "create_clip", "get_tokenizer", "image_features", "image_size", "load_clip",
           "load_pretrained_file", "logits", "preprocess", "register_architectures", "save_clip", "zero_shot_head"]
