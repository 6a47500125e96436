"""The synthetic 2-D problem of Sequential Reptile (trainers.experiments.synthetic)."""

import keras
import numpy as np
import tensorflow as tf

from tf_metaalign import functional as F
from trainers.experiments import synthetic as S


def test_loss_has_its_minimum_at_each_optimum_and_decays_away():
    for optimum in S.OPTIMA:
        assert S.task_loss(np.asarray(optimum), optimum) == -200.0
        assert S.task_loss(np.asarray(optimum) + 1.0, optimum) > -200.0
    far = S.task_loss(np.array([1000.0, 1000.0]), S.OPTIMA[0])
    assert -1e-6 < far < 0.0  # the decaying form (the paper's printed sign is a typo)


def test_model_loss_and_gradient_equal_the_closed_form():
    model = S.point_model(start=(3.0, -2.0), dtype="float64")
    tasks = S.synthetic_tasks(4, dtype="float64")
    x = np.concatenate([v[0] for v in tasks.values()])
    y = np.concatenate([v[1] for v in tasks.values()])
    loss_fn = F.make_loss_fn(model, S.SyntheticTaskLoss(dtype="float64"))
    value, grads, _ = F.value_and_grad(
        loss_fn, F.current_params(model), F.current_state(model), (x, y)
    )
    phi = np.array([3.0, -2.0])
    np.testing.assert_allclose(
        float(value), np.mean([S.task_loss(phi, o) for o in S.OPTIMA]), rtol=1e-12
    )
    expected = np.mean([S.task_gradient(phi, o) for o in S.OPTIMA], axis=0)
    np.testing.assert_allclose(grads[0].numpy(), expected, rtol=1e-10)


def test_mean_pairwise_cosine():
    # Far away along +x every gradient points along +x: cosines -> 1.
    assert S.mean_pairwise_cosine(np.array([300.0, 5.0])) > 0.999
    # At the centroid of the three optima the gradients point to the three corners.
    centroid = np.mean(np.asarray(S.OPTIMA), axis=0)
    g = [S.task_gradient(centroid, o) for o in S.OPTIMA]
    manual = np.mean(
        [a @ b / np.linalg.norm(a) / np.linalg.norm(b) for i, a in enumerate(g) for b in g[i + 1 :]]
    )
    np.testing.assert_allclose(S.mean_pairwise_cosine(centroid), manual, rtol=1e-12)
    assert manual < 0


def test_point_model_saves_as_itself(tmp_path):
    model = S.point_model(start=(1.0, 2.0))
    model.compile(optimizer="sgd", loss=S.SyntheticTaskLoss())
    model.save(tmp_path / "p.keras")
    loaded = keras.models.load_model(tmp_path / "p.keras")
    np.testing.assert_array_equal(loaded.trainable_variables[0].numpy(), [1.0, 2.0])
    assert loaded(tf.zeros((3, 1))).shape == (3, 2)
