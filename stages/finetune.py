"""DVC stage (one per task x variant): fine-tune the image encoder on one task."""

from stages._common import device, run


def stage(params, root, args):
    from mergecal.pipeline import vision

    meta = vision.finetune(params, args.task, args.variant, root, device=device(params))
    print(f"{args.task} ({args.variant}): validation accuracy {meta['val_accuracy']:.3f} in {meta['seconds']:.0f} s")


if __name__ == "__main__":
    raise SystemExit(run(stage))
