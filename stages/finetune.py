"""DVC stage: fine-tune the image encoder on every task in every variant, and on all tasks jointly (the multi-task
reference, ``finetuned/multitask.safetensors``), ``threads`` one-thread fine-tunes at once."""

from stages._common import device, run


def stage(params, root, args):
    from mergecal.pipeline.tracks.clip.built import stages as vision

    vision.finetune_all(params, root, seed=args.seed, device=device(params), workers=params.threads, progress=False)


if __name__ == "__main__":
    raise SystemExit(run(stage, threads=True))
