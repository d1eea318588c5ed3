"""The CLIP family: open_clip-layout CLIPs whose image encoders are merged, every task scored with its frozen
zero-shot head. ``family`` holds what every source shares; a source is where the checkpoints come from, one
package each: ``built`` (the ``vision`` track: the pipeline's own small ViT, its suite, fine-tunes, regimes, seeds
and stability diagnostics) and ``files`` (the ``local_clip`` tracks: a lab's checkpoints in any supported layout,
``mergecal.backbones.clip_checkpoints``, and its datasets)."""
