"""Horovod's TensorFlow (TF1 graph) MNIST example, run on ringreduce by changing only the import.

    mpirun -np 2 python examples/horovod/tensorflow_mnist.py [--use-adasum]
                                                            [--gradient-predivide-factor F]

The script follows Horovod's ``examples/tensorflow/tensorflow_mnist.py``: placeholders, a
two-convolution network with a 1024-unit dense layer and dropout, Adam with the learning
rate scaled by ``hvd.size()`` (by 1 with ``--use-adasum``, ``hvd.local_size()`` if
``hvd.nccl_built()``), ``hvd.DistributedOptimizer`` with ``op=hvd.Adasum`` or
``hvd.Average`` and ``gradient_predivide_factor``, ``hvd.BroadcastGlobalVariablesHook(0)``,
``StopAtStepHook`` at a step count divided by ``hvd.size()``, a ``LoggingTensorHook``, a
``ConfigProto`` pinning the GPU by local rank (harmless without one), checkpoints written
by rank 0 only, and a ``MonitoredTrainingSession`` fed by a shuffling batch generator.
What differs, none of it in the Horovod API:

* TensorFlow 2 runs TF1 graphs through ``tf.compat.v1``: ``import tensorflow.compat.v1 as
  tf`` with ``tf.disable_v2_behavior()`` instead of ``import tensorflow as tf``;
* ``tf.layers`` needs Keras 2, which TensorFlow 2.16+ does not ship: the three functions the
  model uses (``conv2d``, ``dense``, ``dropout``) are written here with
  ``tf.get_variable`` under the same names and arguments; ``tf.estimator`` is gone too,
  so the mode is a plain string;
* the data are scikit-learn's 8x8 digits (MNIST needs a download, and the cache directory
  Horovod creates for it is not needed), flattened to 64 values in [0, 1] like Horovod's
  784; the 2x2 poolings leave 2x2x64 values instead of 7x7x64;
* ``400 // hvd.size()`` steps of batch 100 instead of ``20000 // hvd.size()``;
* a ``FinalOpsHook`` scores the held-out fifth of the digits when training ends, with
  dropout off (its rate fed as 0): each rank scores half of it, ``hvd.allreduce`` sums
  the counts and rank 0 prints ``final test accuracy``: the tests read that line.
"""

from __future__ import annotations

import argparse

import numpy as np
import tensorflow.compat.v1 as tf  # was: import tensorflow as tf
from _digits_data import load_data

import ringreduce.tensorflow as hvd  # was: import horovod.tensorflow as hvd

tf.disable_v2_behavior()


class layers:  # noqa: N801 - stands in for the module tf.layers
    """``tf.layers.conv2d``, ``dense`` and ``dropout`` (Keras 2's, absent from TF 2.16+).

    ``dropout_rates`` holds each dropout's rate as a ``placeholder_with_default``, so that
    the evaluation at the end can feed 0 (Horovod's model applies dropout in every mode).
    """

    dropout_rates = []

    @staticmethod
    def conv2d(x, filters, kernel_size, activation=None, padding="valid"):
        kernel = tf.get_variable("kernel", [*kernel_size, x.shape[-1], filters],
                                 initializer=tf.glorot_uniform_initializer())
        bias = tf.get_variable("bias", [filters], initializer=tf.zeros_initializer())
        y = tf.nn.conv2d(x, kernel, strides=[1, 1, 1, 1], padding=padding.upper()) + bias
        return activation(y) if activation else y

    @staticmethod
    def dense(x, units, activation=None):
        with tf.variable_scope(None, default_name="dense"):  # dense, dense_1, ...
            kernel = tf.get_variable("kernel", [x.shape[-1], units],
                                     initializer=tf.glorot_uniform_initializer())
            bias = tf.get_variable("bias", [units], initializer=tf.zeros_initializer())
        y = tf.matmul(x, kernel) + bias
        return activation(y) if activation else y

    @staticmethod
    def dropout(x, rate=0.5, training=False):
        if not training:
            return x
        layers.dropout_rates.append(tf.placeholder_with_default(rate, [], "dropout_rate"))
        return tf.nn.dropout(x, rate=layers.dropout_rates[-1])


TRAIN = "train"  # was tf.estimator.ModeKeys.TRAIN

STEPS = 400  # for one rank

tf.logging.set_verbosity(tf.logging.INFO)

# Training settings
parser = argparse.ArgumentParser(description='Tensorflow MNIST Example')
parser.add_argument('--use-adasum', action='store_true', default=False,
                    help='use adasum algorithm to do reduction')
parser.add_argument('--gradient-predivide-factor', type=float, default=1.0,
                    help='apply gradient predivide factor in optimizer (default: 1.0)')
args = parser.parse_args()


def conv_model(feature, target, mode):
    """2-layer convolution model."""
    # Convert the target to a one-hot tensor of shape (batch_size, 10) and
    # with a on-value of 1 for each one-hot vector of length 10.
    target = tf.one_hot(tf.cast(target, tf.int32), 10, 1, 0)

    # Reshape feature to 4d tensor with 2nd and 3rd dimensions being
    # image width and height final dimension being the number of color channels.
    feature = tf.reshape(feature, [-1, 8, 8, 1])

    # First conv layer will compute 32 features for each 5x5 patch
    with tf.variable_scope('conv_layer1'):
        h_conv1 = layers.conv2d(feature, 32, kernel_size=[5, 5],
                                activation=tf.nn.relu, padding="SAME")
        h_pool1 = tf.nn.max_pool(
            h_conv1, ksize=[1, 2, 2, 1], strides=[1, 2, 2, 1], padding='SAME')

    # Second conv layer will compute 64 features for each 5x5 patch.
    with tf.variable_scope('conv_layer2'):
        h_conv2 = layers.conv2d(h_pool1, 64, kernel_size=[5, 5],
                                activation=tf.nn.relu, padding="SAME")
        h_pool2 = tf.nn.max_pool(
            h_conv2, ksize=[1, 2, 2, 1], strides=[1, 2, 2, 1], padding='SAME')
        # reshape tensor into a batch of vectors
        h_pool2_flat = tf.reshape(h_pool2, [-1, 2 * 2 * 64])

    # Densely connected layer with 1024 neurons.
    h_fc1 = layers.dropout(
        layers.dense(h_pool2_flat, 1024, activation=tf.nn.relu),
        rate=0.5, training=mode == TRAIN)

    # Compute logits (1 per class) and compute loss.
    logits = layers.dense(h_fc1, 10, activation=None)
    loss = tf.losses.softmax_cross_entropy(target, logits)

    return tf.argmax(logits, 1), loss


def train_input_generator(x_train, y_train, batch_size=64):
    assert len(x_train) == len(y_train)
    while True:
        p = np.random.permutation(len(x_train))
        x_train, y_train = x_train[p], y_train[p]
        index = 0
        while index <= len(x_train) - batch_size:
            yield x_train[index:index + batch_size], \
                y_train[index:index + batch_size],
            index += batch_size


def main(_):
    # Horovod: initialize Horovod.
    hvd.init()

    # Load the digits (Horovod downloads MNIST here).
    (x_train, y_train), (x_test, y_test) = load_data()

    # The shape of the data is (-1, 8, 8), hence we need to reshape it
    # into (-1, 64) to feed into our network. Also, need to normalize the
    # features between 0 and 1.
    x_train = np.reshape(x_train, (-1, 64)) / 16.0
    x_test = np.reshape(x_test, (-1, 64)) / 16.0

    # Build model...
    with tf.name_scope('input'):
        image = tf.placeholder(tf.float32, [None, 64], name='image')
        label = tf.placeholder(tf.float32, [None], name='label')
    predict, loss = conv_model(image, label, TRAIN)

    lr_scaler = hvd.size()
    # By default, Adasum doesn't need scaling when increasing batch size. If used with NCCL,
    # scale lr by local_size
    if args.use_adasum:
        lr_scaler = hvd.local_size() if hvd.nccl_built() else 1

    # Horovod: adjust learning rate based on lr_scaler.
    opt = tf.train.AdamOptimizer(0.001 * lr_scaler)

    # Horovod: add Horovod Distributed Optimizer.
    opt = hvd.DistributedOptimizer(opt, op=hvd.Adasum if args.use_adasum else hvd.Average,
                                   gradient_predivide_factor=args.gradient_predivide_factor)

    global_step = tf.train.get_or_create_global_step()
    train_op = opt.minimize(loss, global_step=global_step)

    # Not in Horovod's example: when training ends, every rank scores its half of the
    # test set without dropout, and the counts are summed over the ranks.
    counts = hvd.allreduce(tf.stack([
        tf.reduce_sum(tf.cast(tf.equal(predict, tf.cast(label, tf.int64)), tf.int64)),
        tf.size(label, out_type=tf.int64)]), op=hvd.Sum, name='test_counts')
    test_feed = {image: x_test[hvd.rank()::hvd.size()], label: y_test[hvd.rank()::hvd.size()]}
    test_feed.update((rate, 0.0) for rate in layers.dropout_rates)
    final_ops_hook = tf.train.FinalOpsHook(counts, final_ops_feed_dict=test_feed)

    hooks = [
        # Horovod: BroadcastGlobalVariablesHook broadcasts initial variable states
        # from rank 0 to all other processes. This is necessary to ensure consistent
        # initialization of all workers when training is started with random weights
        # or restored from a checkpoint.
        hvd.BroadcastGlobalVariablesHook(0),

        # Horovod: adjust number of steps based on number of GPUs.
        tf.train.StopAtStepHook(last_step=STEPS // hvd.size()),

        tf.train.LoggingTensorHook(tensors={'step': global_step, 'loss': loss},
                                   every_n_iter=10),

        final_ops_hook,
    ]

    # Horovod: pin GPU to be used to process local rank (one GPU per process)
    config = tf.ConfigProto()
    config.gpu_options.allow_growth = True
    config.gpu_options.visible_device_list = str(hvd.local_rank())

    # Horovod: save checkpoints only on worker 0 to prevent other workers from
    # corrupting them.
    checkpoint_dir = './checkpoints' if hvd.rank() == 0 else None
    training_batch_generator = train_input_generator(x_train,
                                                     y_train, batch_size=100)
    # The MonitoredTrainingSession takes care of session initialization,
    # restoring from a checkpoint, saving to a checkpoint, and closing when done
    # or an error occurs.
    with tf.train.MonitoredTrainingSession(checkpoint_dir=checkpoint_dir,
                                           hooks=hooks,
                                           config=config) as mon_sess:
        while not mon_sess.should_stop():
            # Run a training step synchronously.
            image_, label_ = next(training_batch_generator)
            mon_sess.run(train_op, feed_dict={image: image_, label: label_})

    correct, total = final_ops_hook.final_ops_values
    if hvd.rank() == 0:
        print(f"final test accuracy: {correct / total:.4f} ({correct}/{total})", flush=True)


if __name__ == "__main__":
    tf.app.run()
