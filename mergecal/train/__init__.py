"""Training: contrastive CLIP pretraining and Ilharco et al.'s image-encoder fine-tuning."""

from .finetune import FinetuneConfig, finetune
from .pretrain_clip import PretrainConfig, clip_loss, cosine_lr, pretrain_clip

__all__ = ["FinetuneConfig", "finetune", "PretrainConfig", "clip_loss", "cosine_lr", "pretrain_clip"]
