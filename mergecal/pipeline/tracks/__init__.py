"""Tracks of the benchmark: a backbone × task set with its own models, inputs and evaluation, one package each
(``tracks/<name>/``: ``params.py`` its params.yaml section, ``stages.py`` what its DVC stages build, ``cells.py``
its cells). ``registry`` maps a cell's track to its package; ``protocol`` is the interface each implements."""
