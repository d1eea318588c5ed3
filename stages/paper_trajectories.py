"""DVC stage (papers/dvc.yaml, `make paper`): DisTaC's trajectory in the default run's regimes (the distac stage
keeps each model's last step alone): conditioned again on the vision track's first fine-tuning seed, every model
checked bit for bit against the stage's, each step's test accuracy, entropy and norm written to
results/papers/distac_trajectories.json."""

import json

from stages._common import device, run

OUTPUT = "results/papers/distac_trajectories.json"


def stage(params, root, args):
    from mergecal.checkpoint import atomic_write_text
    from mergecal.pipeline.tracks.clip.built import stages as vision

    regimes = [r for r in params.vision.regimes if r != "standard"]  # the failure modes DisTaC conditions
    found = vision.distac_trajectories(params, root, device=device(params), regimes=regimes)
    atomic_write_text(root / OUTPUT, json.dumps(found, indent=2, sort_keys=True) + "\n")
    for regime, info in found.items():
        print(f"{regime}: {len(info['conditioned'])} trajectories, each model equal to the distac stage's")


if __name__ == "__main__":
    raise SystemExit(run(stage, threads=True))
