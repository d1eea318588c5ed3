"""One model built at a time per process: the lock that every model construction in a benchmark cell holds.

transformers' ``from_pretrained`` (5.x) patches process-wide functions while it builds a model — every
``torch.nn.init`` function and ``PreTrainedModel.init_weights`` / ``tie_weights`` become no-ops — and puts back
what it found when it is done. Two loads in two threads of one process interleave: the second saves the first's
no-ops as "the originals" and restores them, so the process keeps them for good, and every later load of a model
with tied embeddings leaves its ``lm_head`` untied, uninitialised or on the meta device (transformers PR #44940,
open: "Fix tie_weights skipping logic is not tied to model thread scope"). The benchmark's cells run two at a
time in threads (``runner.kind: threads``), so two LLM cells evaluating at once returned a wrong score in
tests/test_lab_e2e.py. While patched, a concurrent thread's own module construction (open_clip's, seeded) would
also skip its initialisation, and ``create_clip`` reseeds the global RNG: every such construction holds the
lock too (``tests/test_construction_lock.py``). Loads are a small part of a cell; the lock costs no parallelism
that matters.
"""

from __future__ import annotations

import threading

# reentrant: a loader that holds it may call another (load_causal_lm -> from_config) in the same thread
MODEL_CONSTRUCTION = threading.RLock()
