"""
Title: Few-Shot learning with Reptile, meta-trained with tf_metaalign.trainers.ReptileTrainer
Author: [ADMoreau](https://github.com/ADMoreau)
Date created: 2020/05/21
Last modified: 2020/05/30
Description: Few-shot classification on the Omniglot dataset using Reptile.

From keras-io (https://github.com/keras-team/keras-io, examples/vision/reptile.py),
licensed under the Apache License 2.0. Changed here, and only here: the Omniglot data
come from the offline zips through `tf_metaalign.data.omniglot` instead of
`tensorflow_datasets` (a download; see `Dataset.__init__`, and no urllib3 set-up); the
budget and seed are flags (`--meta_iters`, default 2000, and `--eval_interval`, default
1, as published; `--seed`); the plots are drawn on the non-interactive Agg backend, the
smoothing window is capped at the number of evaluations, and the closing figure of
predictions is left out; `model.predict(..., verbose=0)`; the meta-training time is
printed; and after training the example's own evaluation is repeated on `--final_tasks`
test tasks and its mean printed (the program's metric).
See docs/examples.md.
"""

"""
## Introduction

The [Reptile](https://arxiv.org/abs/1803.02999) algorithm was developed by OpenAI to
perform model-agnostic meta-learning. Specifically, this algorithm was designed to
quickly learn to perform new tasks with minimal training (few-shot learning).
The algorithm works by performing Stochastic Gradient Descent using the
difference between weights trained on a mini-batch of never-seen-before data and the
model weights prior to training over a fixed number of meta-iterations.
"""

import argparse

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import random
import tensorflow as tf
from tensorflow import keras
from tensorflow.keras import layers
from tf_metaalign.trainers import ReptileTrainer

parser = argparse.ArgumentParser()
parser.add_argument("--meta_iters", type=int, default=2000)
parser.add_argument("--eval_interval", type=int, default=1)
parser.add_argument("--final_tasks", type=int, default=100)
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()
keras.utils.set_random_seed(args.seed)  # seeds `random` and NumPy too

"""
## Define the Hyperparameters
"""

learning_rate = 0.003
meta_step_size = 0.25

inner_batch_size = 25
eval_batch_size = 25

meta_iters = args.meta_iters
eval_iters = 5
inner_iters = 4

eval_interval = args.eval_interval
train_shots = 20
shots = 5
classes = 5

"""
## Prepare the data

The [Omniglot dataset](https://github.com/brendenlake/omniglot/) is a dataset of 1,623
characters taken from 50 different alphabets, with 20 examples for each character.
The 20 samples for each character were drawn online via Amazon's Mechanical Turk. For the
few-shot learning task, `k` samples (or "shots") are drawn randomly from `n` randomly-chosen
classes. These `n` numerical values are used to create a new set of temporary labels to use
to test the model's ability to learn a new task given few examples. In other words, if you
are training on 5 classes, your new class labels will be either 0, 1, 2, 3, or 4.
Omniglot is a great dataset for this task since there are many different classes to draw
from, with a reasonable number of samples for each class.
"""


class Dataset:
    # This class will facilitate the creation of a few-shot dataset
    # from the Omniglot dataset that can be sampled from quickly while also
    # allowing to create new labels at the same time.
    def __init__(self, training):
        # Offline stand-in for tfds.load("omniglot", split="train"/"test"): the two small
        # background sets of ../shared/data/omniglot (242 characters of 8 alphabets),
        # split by alphabet as tfds's train/test are (178 / 64 characters), 28x28, with
        # tfds's pixel convention (white background, black strokes).
        from tf_metaalign.data.omniglot import load_omniglot, split_classes

        split = split_classes(load_omniglot(), fractions=(0.8, 0.0, 0.2), seed=0,
                              disjoint_alphabets=True)
        classes_of_split = split.train if training else split.test
        self.data = {}
        for label, images in classes_of_split.items():
            self.data[label] = list(1.0 - images)
        self.labels = list(self.data.keys())

    def get_mini_dataset(
        self, batch_size, repetitions, shots, num_classes, split=False
    ):
        temp_labels = np.zeros(shape=(num_classes * shots))
        temp_images = np.zeros(shape=(num_classes * shots, 28, 28, 1))
        if split:
            test_labels = np.zeros(shape=(num_classes))
            test_images = np.zeros(shape=(num_classes, 28, 28, 1))

        # Get a random subset of labels from the entire label set.
        label_subset = random.choices(self.labels, k=num_classes)
        for class_idx, class_obj in enumerate(label_subset):
            # Use enumerated index value as a temporary label for mini-batch in
            # few shot learning.
            temp_labels[class_idx * shots : (class_idx + 1) * shots] = class_idx
            # If creating a split dataset for testing, select an extra sample from each
            # label to create the test dataset.
            if split:
                test_labels[class_idx] = class_idx
                images_to_split = random.choices(
                    self.data[label_subset[class_idx]], k=shots + 1
                )
                test_images[class_idx] = images_to_split[-1]
                temp_images[
                    class_idx * shots : (class_idx + 1) * shots
                ] = images_to_split[:-1]
            else:
                # For each index in the randomly selected label_subset, sample the
                # necessary number of images.
                temp_images[
                    class_idx * shots : (class_idx + 1) * shots
                ] = random.choices(self.data[label_subset[class_idx]], k=shots)

        dataset = tf.data.Dataset.from_tensor_slices(
            (temp_images.astype(np.float32), temp_labels.astype(np.int32))
        )
        dataset = dataset.shuffle(100).batch(batch_size).repeat(repetitions)
        if split:
            return dataset, test_images, test_labels
        return dataset


train_dataset = Dataset(training=True)
test_dataset = Dataset(training=False)

"""
## Visualize some examples from the dataset
"""

_, axarr = plt.subplots(nrows=5, ncols=5, figsize=(20, 20))

sample_keys = list(train_dataset.data.keys())

for a in range(5):
    for b in range(5):
        temp_image = train_dataset.data[sample_keys[a]][b]
        temp_image = np.stack((temp_image[:, :, 0],) * 3, axis=2)
        temp_image *= 255
        temp_image = np.clip(temp_image, 0, 255).astype("uint8")
        if b == 2:
            axarr[a, b].set_title("Class : " + sample_keys[a])
        axarr[a, b].imshow(temp_image, cmap="gray")
        axarr[a, b].xaxis.set_visible(False)
        axarr[a, b].yaxis.set_visible(False)
plt.show()

"""
## Build the model
"""


def conv_bn(x):
    x = layers.Conv2D(filters=64, kernel_size=3, strides=2, padding="same")(x)
    x = layers.BatchNormalization()(x)
    return layers.ReLU()(x)


inputs = layers.Input(shape=(28, 28, 1))
x = conv_bn(inputs)
x = conv_bn(x)
x = conv_bn(x)
x = conv_bn(x)
x = layers.Flatten()(x)
outputs = layers.Dense(classes, activation="softmax")(x)
model = keras.Model(inputs=inputs, outputs=outputs)
model.compile()
optimizer = keras.optimizers.SGD(learning_rate=learning_rate)

"""
## Train the model
"""

# The loop calls model(images) (BatchNorm in inference mode) and differentiates the SUM
# of a batch's losses: inner_training=False and reduction="sum" (see docs/porting.md).
trainer = ReptileTrainer(model, inner_steps=16, inner_optimizer=learning_rate, inner_training=False)
meta_schedule = keras.optimizers.schedules.PolynomialDecay(meta_step_size, meta_iters, 0.0)
sum_loss = keras.losses.SparseCategoricalCrossentropy(reduction="sum")
trainer.compile(optimizer=keras.optimizers.SGD(meta_schedule), loss=sum_loss)
training = []
testing = []
import time  # noqa: E402

start = time.perf_counter()
for meta_iter in range(meta_iters):
    # Get a sample from the full dataset.
    mini_dataset = train_dataset.get_mini_dataset(
        inner_batch_size, inner_iters, train_shots, classes
    )
    # One meta step: its 16 batches stacked into one element [16, 25, 28, 28, 1].
    trainer.fit(mini_dataset.batch(16, drop_remainder=True), verbose=0)
    # Evaluation loop
    if meta_iter % eval_interval == 0:
        accuracies = []
        for dataset in (train_dataset, test_dataset):
            # Sample a mini dataset from the full dataset.
            train_set, test_images, test_labels = dataset.get_mini_dataset(
                eval_batch_size, eval_iters, shots, classes, split=True
            )
            old_vars = model.get_weights()
            # Train on the samples and get the resulting accuracies.
            for images, labels in train_set:
                with tf.GradientTape() as tape:
                    preds = model(images)
                    loss = keras.losses.sparse_categorical_crossentropy(labels, preds)
                grads = tape.gradient(loss, model.trainable_weights)
                optimizer.apply_gradients(zip(grads, model.trainable_weights))
            test_preds = model.predict(test_images, verbose=0)
            test_preds = tf.argmax(test_preds).numpy()
            num_correct = (test_preds == test_labels).sum()
            # Reset the weights after getting the evaluation accuracies.
            model.set_weights(old_vars)
            accuracies.append(num_correct / classes)
        training.append(accuracies[0])
        testing.append(accuracies[1])
        if meta_iter % 100 == 0:
            print(
                "batch %d: train=%f test=%f" % (meta_iter, accuracies[0], accuracies[1])
            )

print("Meta-training time: %.1f s" % (time.perf_counter() - start))

"""
## Visualize Results
"""

# First, some preprocessing to smooth the training and testing arrays for display.
window_length = min(100, len(training))
train_s = np.r_[
    training[window_length - 1 : 0 : -1], training, training[-1:-window_length:-1]
]
test_s = np.r_[
    testing[window_length - 1 : 0 : -1], testing, testing[-1:-window_length:-1]
]
w = np.hamming(window_length)
train_y = np.convolve(w / w.sum(), train_s, mode="valid")
test_y = np.convolve(w / w.sum(), test_s, mode="valid")

# Display the training accuracies.
x = np.arange(0, len(test_y), 1)
plt.plot(x, test_y, x, train_y)
plt.legend(["test", "train"])
plt.grid()

"""
## Final evaluation (added: the program's metric)

The evaluation of the loop above on `--final_tasks` test tasks (5-way 5-shot, one query
per class, 5 SGD steps from the meta-learned weights): mean accuracy and a 95% interval.
The prediction is the arg max over each query's classes (axis -1); the loop above keeps
the published `tf.argmax(test_preds)`, which takes it over axis 0 (over the queries).
"""

final = []
for _ in range(args.final_tasks):
    train_set, test_images, test_labels = test_dataset.get_mini_dataset(
        eval_batch_size, eval_iters, shots, classes, split=True
    )
    old_vars = model.get_weights()
    for images, labels in train_set:
        with tf.GradientTape() as tape:
            preds = model(images)
            loss = keras.losses.sparse_categorical_crossentropy(labels, preds)
        grads = tape.gradient(loss, model.trainable_weights)
        optimizer.apply_gradients(zip(grads, model.trainable_weights))
    test_preds = tf.argmax(model.predict(test_images, verbose=0), axis=-1).numpy()
    model.set_weights(old_vars)
    final.append((test_preds == test_labels).sum() / classes)
print("Final test accuracy: %.4f +/- %.4f" % (np.mean(final), 1.96 * np.std(final) / np.sqrt(len(final))))
