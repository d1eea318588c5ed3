"""The text track: the packaged MiniLM encoder with a head per task (``cells``), built by its DVC stages
(``stages``)."""

from .params import SECTION, TextTrack  # noqa: F401  (its params.yaml section)

TRACK = "text"  # its name in params.yaml and the leaderboard (``mergecal.pipeline.track_registry``)
