"""Independent numpy references used to cross-check mergecal's merge methods (see reference_merging)."""
