"""Offline stand-in for `keras.datasets.imdb.load_data(num_words=...)`: WordNet glosses.

IMDB (a download) is not available offline. The binary task here is real text with two
balanced classes, as IMDB's: is a WordNet 3.0 gloss (definition) the gloss of a NOUN
(label 0) or of a VERB (label 1)? Glosses are read by `trainers.experiments.wordnet` from
/usr/share/wordnet (`apt-get install wordnet-base`; or $WORDNET_DIR). `examples` glosses
of each part of speech are drawn with `seed` (stratified over their supersenses), split
80/20 stratified, and turned into integer sequences as `imdb.load_data` returns them:
word indices ranked by frequency in the training texts, limited to the `num_words` most
frequent (index 0 padding, 1 out-of-vocabulary), tokenised by
`keras.layers.TextVectorization` (lower case, punctuation stripped, split on spaces).
"""

import numpy as np
import keras

from tf_metaalign.data.splits import stratified_split
from trainers.experiments.wordnet import load_wordnet_supersenses


def load_texts(examples=4000, seed=0):
    """(texts, labels) of 2 * `examples` glosses, half nouns (0), half verbs (1)."""
    texts, labels = [], []
    for label, pos in enumerate(("noun", "verb")):
        s = load_wordnet_supersenses(
            pos, test_fraction=0.5, seed=seed, max_examples=2 * examples + 100
        )
        x = np.concatenate([s.x_train, s.x_test])
        rng = np.random.default_rng(seed + label)
        x = x[rng.permutation(len(x))[:examples]]
        if len(x) < examples:
            raise ValueError(f"`examples`: at most {len(x)} {pos} glosses; got {examples}.")
        texts.extend(x)
        labels.extend([label] * examples)
    return np.array(texts, dtype=object), np.array(labels, dtype=np.int32)


def load_data(num_words=20000, examples=4000, seed=0):
    """((x_train, y_train), (x_val, y_val)): lists of int sequences and int labels."""
    texts, labels = load_texts(examples, seed)
    train, val = stratified_split(labels, 0.2, seed)
    vectorize = keras.layers.TextVectorization(max_tokens=num_words, output_mode="int", ragged=True)
    vectorize.adapt(list(texts[train]))

    def encode(idx):
        return [list(map(int, r)) for r in vectorize(list(texts[idx])).to_list()], labels[idx]

    return encode(train), encode(val)
