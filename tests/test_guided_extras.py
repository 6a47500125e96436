"""Schedule plots and the Django translation loader used by the guided experiment."""

import keras
import numpy as np
import pytest

from tf_metaalign import optimizers as O
from tf_metaalign.plotting import SchedulePlotCallback, plot_schedules
from tf_metaalign.trainers.guided import GuidedTrainer


def test_schedule_plot_callback_writes_png(tmp_path):
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(48, 3)).astype("float32"), rng.normal(size=(48, 1)).astype("float32")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    trainer = GuidedTrainer(model, (x[:8], y[:8]), meta_optimizer=O.Adam(0.05))
    trainer.compile(O.Adam(0.01), loss="mse")
    cb = SchedulePlotCallback(tmp_path / "s.png")
    trainer.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[cb])
    assert len(cb.values["learning_rate_scale"]) == 6 and len(cb.values["beta_1"]) == 6
    assert (tmp_path / "s.png").stat().st_size > 1000
    with pytest.raises(ValueError, match="empty"):
        plot_schedules({}, tmp_path / "t.png")


def test_plots_leave_pyplots_backend_alone(tmp_path, monkeypatch):
    """`plot_schedules` and the programs' plots draw on a Figure of their own: a notebook's
    (or a GUI's) pyplot backend is not switched to Agg under it."""
    matplotlib = pytest.importorskip("matplotlib")
    from trainers import common

    switched = []
    monkeypatch.setattr(matplotlib, "use", lambda *a, **k: switched.append(a))
    path = plot_schedules({"run": {"beta_1": [0.9, 0.8, 0.85]}}, tmp_path / "p.png")
    fig = common.figure(figsize=(2, 2))
    fig.subplots().plot([0, 1], [1, 0])
    fig.savefig(tmp_path / "q.png")
    assert switched == []
    assert path.stat().st_size > 1000 and (tmp_path / "q.png").stat().st_size > 500
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_django_pairs_and_char_arrays():
    pytest.importorskip("django", reason="pip install django (the translation pairs)")
    from trainers.experiments import translation

    pairs = translation.load_django_pairs("de", max_chars=40)
    assert len(pairs) > 300
    train, guidance, dev = translation.split_pairs(pairs, 0.15, 64, seed=0)
    assert not set(train) & set(dev) and not set(train) & set(guidance)
    vocab = translation.CharVocab([t for p in train for t in p])
    (enc, dec), lab, mask = translation.make_char_seq2seq(train[:5], vocab, 40)
    assert enc.shape == (5, 40) and dec.shape == lab.shape == (5, 41)
    assert (dec[:, 0] == translation.BOS).all()
    np.testing.assert_array_equal(
        dec[:, 1:], np.where(lab[:, :-1] == translation.EOS, 0, lab[:, :-1])
    )
    assert vocab.decode(lab[0]) == train[0][1][:40]
