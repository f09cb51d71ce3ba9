"""A deliberately broken learner, for checking that the learning canary fails (bench/bench_learning.py
--broken); a stand-in for a bug, never a run's option.

On PYTHONPATH, Python imports this module at start-up in every process (the driver, Ray's workers). When a
process imports learner.gigpo, every advantage estimator in its ADVANTAGE_ESTIMATORS is replaced by one that
returns zeros (the metrics kept): the run plays, trains and pushes as usual, and learns nothing from its
returns, as a learner whose advantages a bug zeroed would. The run's `adv/zero_share` says it took effect."""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys


def _zeroed(estimate):
    def zero_advantages(rows, cfg):
        advantages, metrics = estimate(rows, cfg)
        return advantages * 0.0, metrics
    return zero_advantages


class _BreakAdvantagesOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != "learner.gigpo":
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def load_and_break(module):
            load(module)
            for name, estimate in list(module.ADVANTAGE_ESTIMATORS.items()):
                module.ADVANTAGE_ESTIMATORS[name] = _zeroed(estimate)
        spec.loader.exec_module = load_and_break
        return spec


sys.meta_path.insert(0, _BreakAdvantagesOnImport())
