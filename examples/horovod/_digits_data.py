"""What the TensorFlow ports of Horovod's examples add to Horovod's scripts, written once:
the digits in MNIST's place, and the final line the tests read."""

from __future__ import annotations

from typing import Any

import tensorflow as tf
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split


def load_data() -> tuple:
    """scikit-learn's 8x8 digits as ``((x_train, y_train), (x_test, y_test))``, like
    ``tf.keras.datasets.mnist.load_data()`` (a fixed, stratified 80/20 split)."""
    digits = load_digits()
    x_tr, x_te, y_tr, y_te = train_test_split(digits.images, digits.target, test_size=0.2,
                                              random_state=0, stratify=digits.target)
    return (x_tr, y_tr), (x_te, y_te)


def report_ranks(hvd: Any, accuracy: float, model: tf.keras.Model) -> float:
    """Gather every rank's test accuracy and weight checksum (they must agree); rank 0
    prints ``final test accuracy``. Returns ``accuracy``."""
    checksum = tf.add_n([tf.reduce_sum(tf.cast(v, tf.float64)) for v in model.weights])
    ranks = hvd.allgather(tf.stack([[tf.constant(accuracy, tf.float64), checksum]])).numpy()
    if hvd.rank() == 0:
        print(f"final test accuracy: {accuracy:.4f} (ranks: "
              f"{', '.join(f'{a:.4f}' for a in ranks[:, 0])}; weight checksums: "
              f"{', '.join(f'{c:.10g}' for c in ranks[:, 1])})", flush=True)
    return accuracy
