"""The one list of optimizer configurations the test batteries run on.

Used by the optimizer battery (tests/optimizers/test_optimizers.py: NumPy oracles, the tensor step,
save/restore, ...), the forward-mode battery (tests/test_forward_mode.py) and the guided
batteries (tests/algorithms/test_guided_algorithm.py, tests/trainers/test_guided_trainer.py).
`test_optimizers.py::test_every_exported_optimizer_has_a_registry_entry` fails when an
optimizer class exported by `tf_metaalign.optimizers` has no configuration here.

Each entry: a factory (a fresh optimizer per call) and the configuration of the NumPy
oracle in test_optimizers.py that re-derives its update from the reference formulas
("kind" names the oracle; "lr" is a number or a NumPy function of the global step, i.e.
the number of updates already applied; "clipnorm": the aggregated gradient is clipped to
this global norm first).
"""

import dataclasses
from typing import Callable

from tf_metaalign import optimizers as O

BERT_EXCLUDE = ("LayerNorm", "layer_norm", "bias")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    name: str
    factory: Callable
    oracle: dict


def _bert_schedule_numpy(init_lr, num_train_steps, num_warmup_steps):
    """google-research/bert `create_optimizer`'s rate at a global step, in NumPy."""

    def rate(step):
        decayed = init_lr * (1.0 - min(step, num_train_steps) / num_train_steps)
        if step < num_warmup_steps:
            return init_lr * step / num_warmup_steps
        return decayed

    return rate


def _mesh_adafactor(
    lr,
    b1=None,
    min_dim=128,
    wd=None,
    offset=0,
    exclude_ps=(),
    factored=True,
    parameter_scale=True,
    clipping=1.0,
):
    return dict(
        kind="mesh_adafactor",
        lr=lr,
        b1=b1,
        min_dim=min_dim,
        wd=wd,
        offset=offset,
        exclude_ps=exclude_ps,
        factored=factored,
        parameter_scale=parameter_scale,
        clipping=clipping,
    )


def _bert_adam_family(kind, lr, wd, **options):
    """The oracle `kind` ("bert_adam", "lamb" or "recadam") at google-research/bert's Adam
    constants beta_1 = 0.9, beta_2 = 0.999, epsilon = 1e-6 (LAMB's and RecAdam's too)."""
    return dict(kind=kind, lr=lr, wd=wd, b1=0.9, b2=0.999, eps=1e-6, **options)


_CONFIGS = [
    OptimizerConfig(
        "sgd", lambda: O.SGD(0.1), dict(kind="sgd", lr=0.1, momentum=0.0, nesterov=False)
    ),
    OptimizerConfig(
        "sgd_momentum",
        lambda: O.SGD(0.05, momentum=0.9),
        dict(kind="sgd", lr=0.05, momentum=0.9, nesterov=False),
    ),
    OptimizerConfig(
        "sgd_nesterov",
        lambda: O.SGD(0.05, momentum=0.9, nesterov=True),
        dict(kind="sgd", lr=0.05, momentum=0.9, nesterov=True),
    ),
    OptimizerConfig(
        "adam", lambda: O.Adam(0.01), dict(kind="adam", lr=0.01, b1=0.9, b2=0.999, eps=1e-7)
    ),
    # Keras's AdamW (decoupled decay w -= w * wd * lr before the Adam step), as a rule.
    OptimizerConfig(
        "adamw",
        lambda: O.AdamW(0.01, weight_decay=0.05),
        dict(kind="keras_adamw", lr=0.01, wd=0.05, b1=0.9, b2=0.999, eps=1e-7),
    ),
    # Adafactor's default rate (learning_rate=None): t2t's relative step, 0.01 at first.
    OptimizerConfig(
        "adafactor_relative_step",
        lambda: O.Adafactor(min_dim_size_to_factor=16),
        _mesh_adafactor(lambda step: min(0.01, (step + 1.0) ** -0.5), min_dim=16),
    ),
    OptimizerConfig(
        "adam_weight_decay",
        lambda: O.AdamWeightDecay(0.01, weight_decay_rate=0.05),
        _bert_adam_family("bert_adam", 0.01, wd=0.05, exclude=BERT_EXCLUDE),
    ),
    # BERT's fine-tuning configuration: warmup then linear decay, aggregated clipping at 1.
    OptimizerConfig(
        "bert_adam_weight_decay_schedule",
        lambda: O.AdamWeightDecay(
            O.BertSchedule(0.01, num_train_steps=10, num_warmup_steps=2),
            weight_decay_rate=0.01,
            aggregated_clipnorm=1.0,
        ),
        _bert_adam_family(
            "bert_adam",
            _bert_schedule_numpy(0.01, 10, 2),
            wd=0.01,
            exclude=BERT_EXCLUDE,
            clipnorm=1.0,
        ),
    ),
    OptimizerConfig(
        "lamb",
        lambda: O.Lamb(0.01, weight_decay_rate=0.05),
        _bert_adam_family("lamb", 0.01, wd=0.05, exclude=BERT_EXCLUDE, exclude_la=None, bc=False),
    ),
    OptimizerConfig(
        "lamb_tfa",
        lambda: O.Lamb(
            0.01,
            weight_decay_rate=0.05,
            bias_correction=True,
            exclude_from_layer_adaptation=("scalar",),
        ),
        _bert_adam_family(
            "lamb", 0.01, wd=0.05, exclude=BERT_EXCLUDE, exclude_la=("scalar",), bc=True
        ),
    ),
    OptimizerConfig("adafactor_t5", lambda: O.Adafactor.t5(0.01), _mesh_adafactor(0.01)),
    OptimizerConfig(
        "adafactor_t5_momentum",
        lambda: O.Adafactor(
            0.01,
            beta_1=0.9,
            decay_offset=2,
            weight_decay_rate=1e-3,
            min_dim_size_to_factor=16,
            exclude_from_parameter_scale=("bias",),
        ),
        _mesh_adafactor(0.01, b1=0.9, min_dim=16, wd=1e-3, offset=2, exclude_ps=("bias",)),
    ),
    OptimizerConfig(
        "adafactor_factored_momentum",
        lambda: O.Adafactor(0.01, beta_1=0.5, min_dim_size_to_factor=2),
        _mesh_adafactor(0.01, b1=0.5, min_dim=2),
    ),
    # beta_1 = 0: momentum slot kept (learnable), but no averaging; no update clipping.
    OptimizerConfig(
        "adafactor_zero_momentum_unclipped",
        lambda: O.Adafactor(0.01, beta_1=0.0, min_dim_size_to_factor=2, clipping_threshold=None),
        _mesh_adafactor(0.01, b1=0.0, min_dim=2, clipping=None),
    ),
    OptimizerConfig(
        "adafactor_unfactored_unscaled",
        lambda: O.Adafactor(0.01, beta_1=0.6, factored=False, multiply_by_parameter_scale=False),
        _mesh_adafactor(0.01, b1=0.6, factored=False, parameter_scale=False),
    ),
    # RecAdam (Sanyuan-Chen/RecAdam): a sigmoid annealing that moves over the 5 oracle
    # steps, a pull lr * pretrain_cof small enough to stay stable, decoupled decay.
    OptimizerConfig(
        "recadam",
        lambda: O.RecAdam(
            0.01, anneal_k=0.8, anneal_t0=3, pretrain_cof=4.0, weight_decay_rate=0.02
        ),
        _bert_adam_family(
            "recadam", 0.01, wd=0.02, bias=True, fun="sigmoid", k=0.8, t0=3.0, w=1.0, cof=4.0
        ),
    ),
    OptimizerConfig(
        "recadam_linear_uncorrected",
        lambda: O.RecAdam(
            0.01,
            correct_bias=False,
            anneal_fun="linear",
            anneal_t0=4,
            anneal_w=0.8,
            pretrain_cof=10.0,
        ),
        _bert_adam_family(
            "recadam", 0.01, wd=0.0, bias=False, fun="linear", k=0.0, t0=4.0, w=0.8, cof=10.0
        ),
    ),
    OptimizerConfig(
        "adafactor_pegasus", lambda: O.Adafactor.pegasus(0.01), dict(kind="t2t_adafactor", lr=0.01)
    ),
]

#: name -> OptimizerConfig
REGISTRY = {config.name: config for config in _CONFIGS}
assert len(REGISTRY) == len(_CONFIGS), "duplicate registry names"


def factories(*names):
    """name -> factory for the named entries (all entries when no name is given)."""
    names = names or tuple(REGISTRY)
    return {name: REGISTRY[name].factory for name in names}


def learning_rate_at(config, step):
    """The oracle's learning rate at a global step (number of updates already applied)."""
    lr = config["lr"]
    return float(lr(step)) if callable(lr) else float(lr)


__all__ = ["OptimizerConfig", "REGISTRY", "factories", "learning_rate_at"]
