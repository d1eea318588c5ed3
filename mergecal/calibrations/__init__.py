"""Calibrations of a merge.

Weight space, data-free, per key: ``svc.Svc`` (SVC), ``wsc.Wsc`` (MAGIC WSC).
Feature space: ``fsc.calibrate_fsc`` (MAGIC FSC; DSC = WSC then FSC).
Sensitivity probing for MAGIC: ``probing.probe_sensitivity``.
Before the merge: ``distac.distill_task_vector`` (DisTaC). How confident a model's predictions are (mean entropy,
expected calibration error) is measured by ``mergecal.confidence``, which calibrates nothing (no temperature
scaling). Chains of these around any merge method: ``mergecal.recipe`` and ``mergecal.run_recipe``.
Each recipe step registers itself with its phase in ``registry.CALIBRATIONS``; ``dsc`` holds DSC and DSC-A,
composites that expand to WSC then FSC. Nothing is imported here: the registry loads a module when first asked.
"""
