"""Horovod's TensorFlow 2 Keras MNIST example, run on ringreduce by changing only the import.

    mpirun -np 2 python examples/horovod/tensorflow2_keras_mnist.py
    python examples/horovod/tensorflow2_keras_mnist.py 2 localhost:2 gloo   # through run()

The script follows Horovod's ``examples/tensorflow2/tensorflow2_keras_mnist.py``:
``hvd.init()``, GPU pinning by local rank (a no-op without GPUs), a repeated and shuffled
``tf.data`` pipeline, the learning rate scaled by ``hvd.size()``, ``DistributedOptimizer``
(``backward_passes_per_step=1, average_aggregated_gradients=True``), the callbacks
``BroadcastGlobalVariablesCallback(0)``, ``MetricAverageCallback()`` and
``LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=3, verbose=1)``, a
``ModelCheckpoint('./checkpoint-{epoch}.h5')`` on rank 0 only, steps per epoch divided by
``hvd.size()``, and the ``horovod.run(train, np=..., hosts=..., use_gloo=..., use_mpi=...)``
entry point when given three arguments (``import horovod`` became ``import ringreduce as
horovod``). What differs, none of it in the Horovod API:

* the data are scikit-learn's 8x8 digits (MNIST needs a download), scaled by 1/16; the
  network is Horovod's, whose two valid 3x3 convolutions and 2x2 pooling fit 8x8 images;
* 8 epochs of ``48 // hvd.size()`` steps instead of 24 of ``500 // hvd.size()``;
* ``compile`` no longer gets ``experimental_run_tf_function=False``: Keras 3 removed that
  argument (its ``fit`` always calls the optimizer's ``apply``, which
  ``DistributedOptimizer`` replaces);
* after ``fit`` every rank scores the held-out fifth of the digits and rank 0 prints
  ``final test accuracy`` with every rank's accuracy and a checksum of its weights, which
  must agree (``hvd.allgather``): the tests read that line.
"""

from __future__ import annotations

import sys

import tensorflow as tf
from _digits_data import load_data, report_ranks

import ringreduce as horovod  # was: import horovod
import ringreduce.keras as hvd  # was: import horovod.tensorflow.keras as hvd

EPOCHS = 8
STEPS = 48  # per epoch, for one rank


def report(model: tf.keras.Model, test: tuple) -> float:
    """Score the test split on every rank; rank 0 prints every rank's accuracy and weights."""
    images, labels = test
    _, accuracy = model.evaluate(tf.cast(images[..., tf.newaxis] / 16.0, tf.float32), labels,
                                 verbose=0)
    return report_ranks(hvd, accuracy, model)


def train() -> tf.keras.Model:
    # Horovod: initialize Horovod.
    hvd.init()

    # Horovod: pin GPU to be used to process local rank (one GPU per process)
    gpus = tf.config.experimental.list_physical_devices('GPU')
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    if gpus:
        tf.config.experimental.set_visible_devices(gpus[hvd.local_rank()], 'GPU')

    (mnist_images, mnist_labels), test = load_data()

    dataset = tf.data.Dataset.from_tensor_slices(
        (tf.cast(mnist_images[..., tf.newaxis] / 16.0, tf.float32),
         tf.cast(mnist_labels, tf.int64))
    )
    dataset = dataset.repeat().shuffle(10000).batch(128)

    mnist_model = tf.keras.Sequential([
        tf.keras.layers.Conv2D(32, [3, 3], activation='relu'),
        tf.keras.layers.Conv2D(64, [3, 3], activation='relu'),
        tf.keras.layers.MaxPooling2D(pool_size=(2, 2)),
        tf.keras.layers.Dropout(0.25),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(128, activation='relu'),
        tf.keras.layers.Dropout(0.5),
        tf.keras.layers.Dense(10, activation='softmax')
    ])

    # Horovod: adjust learning rate based on number of GPUs.
    scaled_lr = 0.001 * hvd.size()
    opt = tf.optimizers.Adam(scaled_lr)

    # Horovod: add Horovod DistributedOptimizer.
    opt = hvd.DistributedOptimizer(
        opt, backward_passes_per_step=1, average_aggregated_gradients=True)

    # (Horovod passes experimental_run_tf_function=False here, which Keras 3 refuses.)
    mnist_model.compile(loss=tf.losses.SparseCategoricalCrossentropy(),
                        optimizer=opt,
                        metrics=['accuracy'])

    callbacks = [
        # Horovod: broadcast initial variable states from rank 0 to all other processes.
        # This is necessary to ensure consistent initialization of all workers when
        # training is started with random weights or restored from a checkpoint.
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),

        # Horovod: average metrics among workers at the end of every epoch.
        #
        # Note: This callback must be in the list before the ReduceLROnPlateau,
        # TensorBoard or other metrics-based callbacks.
        hvd.callbacks.MetricAverageCallback(),

        # Horovod: using `lr = 1.0 * hvd.size()` from the very beginning leads to worse final
        # accuracy. Scale the learning rate `lr = 1.0` ---> `lr = 1.0 * hvd.size()` during
        # the first three epochs. See https://arxiv.org/abs/1706.02677 for details.
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=3,
                                                 verbose=1),
    ]

    # Horovod: save checkpoints only on worker 0 to prevent other workers from corrupting them.
    if hvd.rank() == 0:
        callbacks.append(tf.keras.callbacks.ModelCheckpoint('./checkpoint-{epoch}.h5'))

    # Horovod: write logs on worker 0.
    verbose = 1 if hvd.rank() == 0 else 0

    # Train the model.
    # Horovod: adjust number of steps based on number of GPUs.
    mnist_model.fit(dataset, steps_per_epoch=STEPS // hvd.size(), callbacks=callbacks,
                    epochs=EPOCHS, verbose=verbose)

    report(mnist_model, test)

    # Return the model
    return mnist_model


if __name__ == '__main__':
    if len(sys.argv) == 4:
        # run training through horovod.run
        np = int(sys.argv[1])
        hosts = sys.argv[2]
        comm = sys.argv[3]
        print('Running training through horovod.run')
        models = horovod.run(train, np=np, hosts=hosts, use_gloo=comm == 'gloo',
                             use_mpi=comm == 'mpi', verbose=2)
    else:
        # this is running via horovodrun
        train()
