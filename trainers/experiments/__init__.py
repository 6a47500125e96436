"""What our experiments run on (not library code: `tf_metaalign` never imports it).

The task builders, pipelines and models of this repository's paper reproductions, used
by the programs in `trainers/`, the benchmarks, the examples and the notebooks; they run
from a checkout (the repository root on `sys.path`), they are not installed with the
package.

  wordnet           WordNet 3.0 gloss -> supersense (`apt-get install wordnet-base`),
                    one task per part of speech (the main job's data)
  django_catalogs   Django's gettext catalogs as multilingual tasks
  translation       Django's catalogs as English -> X translation pairs
  text_encoder      the pretrained all-MiniLM-L6-v2 encoder through keras-hub, offline
  prompted_tasks    the offline prompted tasks of the promptability experiment
  english_corpus    the offline English corpus the small T5 and GPT-2 pre-train on
  t5_vocabulary     a T5-style SentencePiece vocabulary trained on it, T5's special ids
  t5_objectives     T5's span corruption and LM adaptation on token ids
  text_pretraining  the small-T5 pre-training examples (the objectives packed as features)
  pretrained_cache  the cache of the small pre-trained models, keyed by their settings
  small_t5          the small T5 the promptability experiment pre-trains
  small_gpt2        the small GPT-2 of the decoder experiment (`promptability_decoder`)
  synthetic         the synthetic problems (the Sequential Reptile paper's Fig. 3, DotProd's)
"""
