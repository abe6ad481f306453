"""``import ringreduce.tensorflow.keras as hvd``: the path of ``horovod.tensorflow.keras``.

Everything is ``ringreduce.keras``'s (``hvd.callbacks.MetricAverageCallback()``,
``hvd.elastic.KerasState`` and all).
"""

import sys

from ringreduce.keras import *  # noqa: F403
from ringreduce.keras import __all__, callbacks, elastic  # noqa: F401

# `import ringreduce.tensorflow.keras.elastic` (horovod.tensorflow.keras.elastic's path).
sys.modules[__name__ + ".elastic"] = elastic
sys.modules[__name__ + ".callbacks"] = callbacks
