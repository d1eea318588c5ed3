"""Seq2seq tracks from local directories (``local_seq2seq:`` in params.yaml): their cells (``cells``) and what
their stages check and record (``stages``)."""

from .params import SECTION, LocalSeq2SeqTrack  # noqa: F401  (its params.yaml section)

TRACK = "local_seq2seq"  # its name in params.yaml and the leaderboard (``mergecal.pipeline.track_registry``)
