"""The vision track: the project's small open_clip ViT, fine-tuned per task, in three regimes (``cells``), built
by its DVC stages (``stages``)."""

from .params import SECTION, VisionTrack  # noqa: F401  (its params.yaml section)

TRACK = "vision"  # its name in params.yaml and the leaderboard (``mergecal.pipeline.track_registry``)
