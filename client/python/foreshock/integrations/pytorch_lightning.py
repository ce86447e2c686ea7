"""foreshock.integrations.lightning's ForeshockCallback for the `pytorch_lightning`
package (Lightning's Trainer accepts only callbacks of its own package)."""
try:
    import pytorch_lightning as _pl
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("foreshock.integrations.pytorch_lightning needs pytorch_lightning "
                      "(pip install pytorch-lightning)") from e

from foreshock.integrations._lightning_impl import ForeshockCallbackMixin


class ForeshockCallback(ForeshockCallbackMixin, _pl.Callback):
    __doc__ = ForeshockCallbackMixin.__doc__
