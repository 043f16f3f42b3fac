"""Training tasks: the plug-in interface and the built-in byte-level LM. No networking here."""

from neuronode.training.task import *  # noqa: F403 - the plug-in API is task.__all__
from neuronode.training.task import __all__ as __all__
