"""Horovod's TensorFlow 2 MNIST example, run on ringreduce by changing only the import.

    mpirun -np 2 python examples/horovod/tensorflow2_mnist.py
    python examples/horovod/tensorflow2_mnist.py 2 localhost:2 gloo   # through run()

The script follows Horovod's ``examples/tensorflow2/tensorflow2_mnist.py``: ``hvd.init()``,
GPU pinning by local rank (a no-op without GPUs), a repeated and shuffled ``tf.data``
pipeline, Adam with the learning rate scaled by ``hvd.size()``, a ``tf.function`` training
step whose ``tf.GradientTape`` is wrapped in ``hvd.DistributedGradientTape``, model and
optimizer variables broadcast from rank 0 with ``hvd.broadcast_variables`` after the
first step, the number of steps divided by ``hvd.size()``, a ``tf.train.Checkpoint``
saved by rank 0 only, and the ``horovod.run(train, np=..., hosts=..., use_gloo=...,
use_mpi=...)`` entry point when given three arguments (``import horovod`` became ``import
ringreduce as horovod``). What differs, none of it in the Horovod API:

* the data are scikit-learn's 8x8 digits (MNIST needs a download), scaled by 1/16; the
  network is Horovod's, whose two valid 3x3 convolutions and 2x2 pooling fit 8x8 images;
* ``400 // hvd.size()`` steps of batch 128 instead of ``10000 // hvd.size()``;
* ``opt.variables`` instead of ``opt.variables()``: a Keras 3 optimizer's ``variables`` is
  a property (Horovod's example was written for Keras 2's optimizers, whose was a method);
* at the end every rank scores the held-out fifth of the digits and rank 0 prints
  ``final test accuracy`` with every rank's accuracy and a checksum of its weights, which
  must agree (``hvd.allgather``): the tests read that line.
"""

from __future__ import annotations

import sys

import tensorflow as tf
from _digits_data import load_data, report_ranks

import ringreduce as horovod  # was: import horovod
import ringreduce.tensorflow as hvd  # was: import horovod.tensorflow as hvd

STEPS = 400  # for one rank


def report(model: tf.keras.Model, test: tuple) -> float:
    """Score the test split on every rank; rank 0 prints every rank's accuracy and weights."""
    images, labels = test
    probs = model(tf.cast(images[..., tf.newaxis] / 16.0, tf.float32), training=False)
    accuracy = tf.reduce_mean(tf.cast(tf.equal(tf.argmax(probs, 1), labels), tf.float64))
    return report_ranks(hvd, float(accuracy), model)


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
    loss = tf.losses.SparseCategoricalCrossentropy()

    # Horovod: adjust learning rate based on number of GPUs.
    opt = tf.optimizers.Adam(0.001 * hvd.size())

    checkpoint_dir = './checkpoints'
    checkpoint = tf.train.Checkpoint(model=mnist_model, optimizer=opt)

    @tf.function
    def training_step(images, labels, first_batch):
        with tf.GradientTape() as tape:
            probs = mnist_model(images, training=True)
            loss_value = loss(labels, probs)

        # Horovod: add Horovod Distributed GradientTape.
        tape = hvd.DistributedGradientTape(tape)

        grads = tape.gradient(loss_value, mnist_model.trainable_variables)
        opt.apply_gradients(zip(grads, mnist_model.trainable_variables))

        # Horovod: broadcast initial variable states from rank 0 to all other processes.
        # This is necessary to ensure consistent initialization of all workers when
        # training is started with random weights or restored from a checkpoint.
        #
        # Note: broadcast should be done after the first gradient step to ensure optimizer
        # initialization.
        if first_batch:
            hvd.broadcast_variables(mnist_model.variables, root_rank=0)
            hvd.broadcast_variables(opt.variables, root_rank=0)  # Keras 2: opt.variables()

        return loss_value

    # Horovod: adjust number of steps based on number of GPUs.
    for batch, (images, labels) in enumerate(dataset.take(STEPS // hvd.size())):
        loss_value = training_step(images, labels, batch == 0)

        if batch % 10 == 0 and hvd.local_rank() == 0:
            print(f'Step #{batch}\tLoss: {loss_value:.6f}')

    report(mnist_model, test)

    # Horovod: save checkpoints only on worker 0 to prevent other workers from
    # corrupting it.
    if hvd.rank() == 0:
        checkpoint.save(checkpoint_dir)
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
