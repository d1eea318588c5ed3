"""The tracks of the benchmark, one package per model family (``tracks/<family>/``: what its sources share) and one
sub-package per source (``tracks/<family>/<source>/``: ``__init__.py`` names its track, ``params.py`` its params.yaml
section, ``stages.py`` what its DVC stages build, ``cells.py`` its cells). ``mergecal.pipeline.track_registry``
finds the sources; ``protocol`` is the interface each implements."""
