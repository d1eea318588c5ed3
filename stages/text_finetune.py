"""DVC stage (one per text task): fine-tune MiniLM with the task's own head."""

from stages._common import device, run


def stage(params, root, args):
    from mergecal.pipeline import text

    meta = text.finetune(params, args.task, root, device=device(params))
    print(f"{args.task}: validation accuracy {meta['val_accuracy']:.3f} in {meta['seconds']:.0f} s")


if __name__ == "__main__":
    raise SystemExit(run(stage))
