"""DVC stage (papers/dvc.yaml, `make paper`): the seq2seq track's suite in text-to-text form (data/seq2seq/) and its
tiny T5 pretrained by span corruption (models/<seq2seq.backbone>/base/)."""

from stages._common import device, run


def stage(params, root, args):
    from mergecal.pipeline.tracks.seq2seq.built import stages as seq2seq

    manifest = seq2seq.build_data(params, root)
    print(f"seq2seq data: {len(manifest['files'])} files")
    info = seq2seq.pretrain(params, root, device=device(params), progress=False)
    print(f"tiny T5: {info['parameters']} parameters, span-corruption loss {info.get('final_loss')}")


if __name__ == "__main__":
    raise SystemExit(run(stage, threads=True))
