"""Settings every source of the causal-LM family shares in its params.yaml section."""

from __future__ import annotations

from ....config_types import Count
from ...params_base import Strict


class LlmEvaluation(Strict):
    """lm-eval settings of a causal-LM track: documents per task on validation (choosing the scaling; all of them
    when larger than the split) and the batch size of each lm-eval scoring call."""

    max_validation: Count = 150
    batch_size: Count = 32
