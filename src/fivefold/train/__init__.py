"""Training: the trainer, optimizer, precision, checkpoints, metrics and generation.

`fivefold.train` is this package and, called, the library's whole training loop
(`fivefold.train(cfg)` is `fivefold.api.train(cfg)`): a package cannot share its name with a
function, so the package's module object is made callable.
"""

import sys
import types


class _CallablePackage(types.ModuleType):
    def __call__(self, cfg=None, **sections):
        from fivefold.api import train

        return train(cfg, **sections)


sys.modules[__name__].__class__ = _CallablePackage
