"""``import ringreduce.tensorflow.keras as hvd``: the path of ``horovod.tensorflow.keras``.

Everything is ``ringreduce.keras``'s (``hvd.callbacks.MetricAverageCallback()`` and all).
"""

from ringreduce.keras import *  # noqa: F403
from ringreduce.keras import __all__, callbacks  # noqa: F401
