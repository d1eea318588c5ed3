"""Calibrations of a merge: SVC, MAGIC (probing, WSC, FSC, DSC) and DisTaC."""
