"""Analyses of merges that compute the data of papers' figures (no plotting here)."""
