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
  text_pretraining  the small-T5 pre-training pipeline (SentencePiece, span corruption)
  small_t5          the small T5 the promptability experiment pre-trains
  synthetic         the synthetic problems (the Sequential Reptile paper's Fig. 3, DotProd's)
"""
