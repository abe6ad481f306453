"""Horovod's TensorFlow 2 synthetic benchmark, run on ringreduce by changing only the import.

    mpirun -np 2 python examples/horovod/tensorflow2_synthetic_benchmark.py [--fp16-allreduce]

The structure and flags of Horovod's ``examples/tensorflow2/tensorflow2_synthetic_benchmark.py``:
random images and labels, a ``tf.function`` step with ``hvd.DistributedGradientTape``
(optionally ``Compression.fp16``), model and optimizer variables broadcast after the first
step, warm-up batches, then ``--num-iters`` timed iterations of ``--num-batches-per-iter``
steps, images/sec per device and in total (mean +- 1.96 std). What differs, none of it in
the Horovod API:

* ``--model`` names a ``tf.keras.applications`` model as in Horovod, built for
  ``--image-size`` images (Horovod's are 224x224, which ``ResNet50`` on two CPU cores takes
  seconds per image for); the default is the built-in ``small_resnet``, a ResNet-style CNN
  of about 1.2 M parameters (as in ``pytorch_synthetic_benchmark.py``), and the default
  sizes are small (batch 16, 32x32 images, 2 + 5 x 5 batches);
* ``opt.variables`` instead of ``opt.variables()``: a Keras 3 optimizer's ``variables`` is a
  property (Horovod's example was written for Keras 2's optimizers, whose was a method);
* without a GPU the device is ``CPU`` even without ``--no-cuda`` (Horovod's would log
  "GPU" and let TensorFlow place the ops on the CPU).
"""

from __future__ import annotations

import argparse
import os
import timeit

import numpy as np
import tensorflow as tf
from tensorflow.keras import applications

import ringreduce.tensorflow as hvd  # was: import horovod.tensorflow as hvd

# Benchmark settings
parser = argparse.ArgumentParser(description='TensorFlow Synthetic Benchmark',
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument('--fp16-allreduce', action='store_true', default=False,
                    help='use fp16 compression during allreduce')

parser.add_argument('--model', type=str, default='small_resnet',
                    help='model to benchmark (a tf.keras.applications name, or small_resnet)')
parser.add_argument('--batch-size', type=int, default=16,
                    help='input batch size')
parser.add_argument('--image-size', type=int, default=32,
                    help='input image side (Horovod: 224)')

parser.add_argument('--num-warmup-batches', type=int, default=2,
                    help='number of warm-up batches that don\'t count towards benchmark')
parser.add_argument('--num-batches-per-iter', type=int, default=5,
                    help='number of batches per benchmark iteration')
parser.add_argument('--num-iters', type=int, default=5,
                    help='number of benchmark iterations')

parser.add_argument('--no-cuda', action='store_true', default=False,
                    help='disables CUDA training')


def small_resnet(image_size: int, num_classes: int = 1000) -> tf.keras.Model:
    """Four residual stages of two 3x3 convolutions each (about 1.2 M parameters)."""
    layers = tf.keras.layers

    def block(x: tf.Tensor, width: int, stride: int) -> tf.Tensor:
        y = layers.Conv2D(width, 3, stride, padding='same', use_bias=False)(x)
        y = layers.ReLU()(layers.BatchNormalization()(y))
        y = layers.BatchNormalization()(layers.Conv2D(width, 3, padding='same',
                                                      use_bias=False)(y))
        if stride != 1 or x.shape[-1] != width:
            x = layers.Conv2D(width, 1, stride, use_bias=False)(x)
        return layers.ReLU()(y + x)

    inputs = tf.keras.Input((image_size, image_size, 3))
    x = layers.ReLU()(layers.BatchNormalization()(
        layers.Conv2D(32, 3, padding='same', use_bias=False)(inputs)))
    for i, width in enumerate([32, 64, 128, 256]):
        x = block(x, width, 1 if i == 0 else 2)
    x = layers.GlobalAveragePooling2D()(x)
    return tf.keras.Model(inputs, layers.Dense(num_classes, activation='softmax')(x))


args = parser.parse_args()
args.cuda = not args.no_cuda and bool(tf.config.experimental.list_physical_devices('GPU'))

# Horovod: initialize Horovod.
hvd.init()

# Horovod: pin GPU to be used to process local rank (one GPU per process)
if args.cuda:
    gpus = tf.config.experimental.list_physical_devices('GPU')
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    if gpus:
        tf.config.experimental.set_visible_devices(gpus[hvd.local_rank()], 'GPU')
else:
    os.environ["CUDA_VISIBLE_DEVICES"] = "-1"

# Set up standard model.
if args.model == 'small_resnet':
    model = small_resnet(args.image_size)
else:
    model = getattr(applications, args.model)(
        weights=None, input_shape=(args.image_size, args.image_size, 3))
opt = tf.optimizers.SGD(0.01)

data = tf.random.uniform([args.batch_size, args.image_size, args.image_size, 3])
target = tf.random.uniform([args.batch_size, 1], minval=0, maxval=999, dtype=tf.int64)


@tf.function
def benchmark_step(first_batch):
    # Horovod: (optional) compression algorithm.
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none

    # Horovod: use DistributedGradientTape
    with tf.GradientTape() as tape:
        probs = model(data, training=True)
        loss = tf.losses.sparse_categorical_crossentropy(target, probs)

    # Horovod: add Horovod Distributed GradientTape.
    tape = hvd.DistributedGradientTape(tape, compression=compression)

    gradients = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(gradients, model.trainable_variables))

    # Horovod: broadcast initial variable states from rank 0 to all other processes.
    # This is necessary to ensure consistent initialization of all workers when
    # training is started with random weights or restored from a checkpoint.
    #
    # Note: broadcast should be done after the first gradient step to ensure optimizer
    # initialization.
    if first_batch:
        hvd.broadcast_variables(model.variables, root_rank=0)
        hvd.broadcast_variables(opt.variables, root_rank=0)  # Keras 2: opt.variables()


def log(s, nl=True):
    if hvd.rank() != 0:
        return
    print(s, end='\n' if nl else '', flush=True)


log(f'Model: {args.model}')
log(f'Batch size: {args.batch_size}')
device = 'GPU' if args.cuda else 'CPU'
log(f'Number of {device}s: {hvd.size()}')


with tf.device(device):
    # Warm-up
    log('Running warmup...')
    benchmark_step(first_batch=True)
    timeit.timeit(lambda: benchmark_step(first_batch=False),
                  number=args.num_warmup_batches)

    # Benchmark
    log('Running benchmark...')
    img_secs = []
    for x in range(args.num_iters):
        time = timeit.timeit(lambda: benchmark_step(first_batch=False),
                             number=args.num_batches_per_iter)
        img_sec = args.batch_size * args.num_batches_per_iter / time
        log(f'Iter #{x}: {img_sec:.1f} img/sec per {device}')
        img_secs.append(img_sec)

    # Results
    img_sec_mean = np.mean(img_secs)
    img_sec_conf = 1.96 * np.std(img_secs)
    log(f'Img/sec per {device}: {img_sec_mean:.1f} +-{img_sec_conf:.1f}')
    log(f'Total img/sec on {hvd.size()} {device}(s): {hvd.size() * img_sec_mean:.1f} '
        f'+-{hvd.size() * img_sec_conf:.1f}')
