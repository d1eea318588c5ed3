"""Calibrations of a merge.

Weight space, data-free, per key: ``svc.Svc`` (SVC), ``wsc.Wsc`` (MAGIC WSC).
Feature space: ``fsc.calibrate_fsc`` (MAGIC FSC; DSC = WSC then FSC).
Sensitivity probing for MAGIC: ``probing.probe_sensitivity``.
Before the merge: ``distac.distill_task_vector`` (DisTaC); after it: ``confidence`` (temperature scaling,
entropy, ECE). Chains of these around any merge method: ``mergecal.recipe`` and ``mergecal.run_recipe``.
"""
