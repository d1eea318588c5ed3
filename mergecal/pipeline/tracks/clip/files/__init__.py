"""CLIP tracks from local files (``local_clip:`` in params.yaml): their cells (``cells``), what their stages
check and record (``stages``) and the data chains' stages (``calibration``: DisTaC, sensitivity)."""

from .params import SECTION, LocalClipTrack  # noqa: F401  (its params.yaml section)

TRACK = "local_clip"  # its name in params.yaml and the leaderboard (``mergecal.pipeline.track_registry``)
