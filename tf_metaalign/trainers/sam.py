"""`SAMTrainer` (SAM, ASAM) and `GSAMTrainer` (GSAM) inside `model.fit`."""

from __future__ import annotations

import keras
from keras import ops

from tf_metaalign import functional as F
from tf_metaalign.algorithms import sam
from tf_metaalign.trainers.base import MetaTrainer

#: Variables ASAM leaves unscaled (T = 1): SamsungLabs/ASAM scales the parameters whose
#: PyTorch name holds "weight" (kernels, embeddings, normalisation scales), not biases.
ASAM_UNSCALED_NAMES = ("bias", "beta")


@keras.saving.register_keras_serializable(package="tf_metaalign")
class SAMTrainer(MetaTrainer):
    """Train `model` with sharpness-aware minimisation (SAM, or ASAM with `adaptive=True`).

    Each step (per replica, under a strategy) takes the clean gradient g at the weights
    w, the perturbation e(w) = rho g / ||g|| (ASAM: rho T^2 g / ||T g||, T = |w| + eta on
    every variable but biases), the gradient g_p at w + e(w) on the same batch, and hands
    g_p to the compiled optimizer, which applies it at w (the weights are never assigned
    w + e). See `tf_metaalign.algorithms.sam` for the reference semantics (google-research
    /sam, SamsungLabs/ASAM, big_vision) and where this differs.

    * Model state: the BatchNorm moving statistics and the dropout seed are those of the
      clean pass (optax's BatchNorm-aware `opaque_mode`); the perturbed pass uses the same
      dropout masks as the clean one and its state is discarded.
    * Mixed precision: with a `LossScaleOptimizer`, e(w) is built from the unscaled
      gradient; a non-finite gradient gives a non-finite g_p, and the LossScaleOptimizer
      skips that step (the weights do not move) and lowers its scale.
    * Distribution: by default the perturbation uses the global gradient (one all-reduce
      of g per step), so R replicas take the step of one replica on the global batch.
      `m_sharpness=True` perturbs each replica along its own shard's gradient (the SAM
      paper's m-sharpness with m = the per-replica batch; no extra communication) and the
      optimizer averages the replicas' g_p.
    * On JAX the step sees the global batch (`keras.distribution.DataParallel` shards it;
      one jitted SPMD step), so the default perturbation is the global one on any number
      of devices, as on one TensorFlow replica. `m_sharpness=True` splits the batch into
      one group of consecutive rows per device along the distribution's batch axis (the
      rows that device holds, as a TensorFlow replica holds its shard), takes each
      group's SAM (GSAM) step with `keras.ops.vectorized_map` and averages the groups'
      directions, losses and diagnostics: TensorFlow's per-replica m-sharpness, on the
      same rows. Where it differs: the model state (BatchNorm statistics) kept is the
      mean over the groups of each group's statistics (a seed state: the first group's;
      the groups draw the same dropout masks, of their own shape); the batch must be a
      multiple of the devices (else a ValueError naming `m_sharpness`); on one device, or
      without a distribution, it is the global perturbation (as on one TF replica).
    * Cost: two forward+backward passes per step. `every=k` perturbs on steps 0, k, 2k,
      ... only (counted from the start of training, checkpointed); the other steps are
      plain steps (one pass; under several replicas with the global perturbation, the
      all-reduce of g still runs, since it may not sit in a `tf.cond`).
    * `rho=0`: plain training (one pass, g applied), identical to the model's own `fit`.

    Logs: loss (the clean loss L(w)), the compiled metrics (on the clean pass's outputs),
    `grad_norm` (||g||, ASAM: ||T g||, of the mean gradient the perturbation was built
    from) and `surrogate_gap` (L(w + e) - L(w), averaged over the perturbed steps).

    Args:
      model: the Keras model to train (`trainer.model`).
      rho: the neighbourhood size (SAM's default 0.05; ASAM's paper uses 0.5 to 2).
      adaptive: False: SAM. True: ASAM (scale-invariant perturbation).
      eta: ASAM's T = |w| + eta offset (default 0.01, SamsungLabs/ASAM's).
      every: perturb on every `every`-th step only (1 = always).
      m_sharpness: perturb per replica (TensorFlow strategy) or per device's rows (JAX
        `keras.distribution`) along that shard's own gradient instead of the global one
        (no effect on one replica / device).
      **kwargs: passed to `keras.Model`.

    Returns:
      A `keras.Model` to `compile` (keywords: `optimizer=`, `loss=`, `metrics=`) and `fit`;
      `trainer.model` is the user's model, trained.

    Example:
      >>> import keras, numpy as np
      >>> from tf_metaalign.trainers import SAMTrainer
      >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
      >>> trainer = SAMTrainer(model, rho=0.05)
      >>> trainer.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
      >>> x, y = np.ones((8, 3), "float32"), np.ones((8, 1), "float32")
      >>> history = trainer.fit(x, y, batch_size=4, epochs=2, verbose=0)
      >>> sorted(k for k in history.history if k != "loss")
      ['grad_norm', 'surrogate_gap']

    References:
      Foret et al., "Sharpness-Aware Minimization for Efficiently Improving
      Generalization", ICLR 2021. Kwon et al., "ASAM: Adaptive Sharpness-Aware
      Minimization for Scale-Invariant Learning of Deep Neural Networks", ICML 2021.
    """

    backends = ("tensorflow", "jax")

    def __init__(
        self,
        model: keras.Model,
        rho: float = 0.05,
        adaptive: bool = False,
        eta: float = 0.01,
        every: int = 1,
        m_sharpness: bool = False,
        **kwargs,
    ):
        sam.validate_options(rho, adaptive, eta, every)
        if not isinstance(m_sharpness, bool):
            raise ValueError(f"`m_sharpness` must be True or False; got {m_sharpness!r}.")
        super().__init__(model, **kwargs)
        self.rho = float(rho)
        self.adaptive = adaptive
        self.eta = float(eta)
        self.every = int(every)
        self.m_sharpness = m_sharpness
        # Steps seen since the start of training: drives `every`, checkpointed.
        self.schedule = self.every_k_steps(self.every, name="sam_steps")
        self.add_diagnostic("grad_norm", "mean")
        self.add_diagnostic("surrogate_gap", "mean")

    @property
    def steps_seen(self):
        """Train steps seen since the start of training (a checkpointed int64)."""
        return self.schedule.count

    # ---------------------------------------------------------------- GSAM's hooks

    def gsam_alpha(self):
        """None for SAM / ASAM; GSAM's alpha (see `GSAMTrainer`)."""
        return None

    def current_rho(self):
        """The step's rho: a python float for SAM (GSAM: a tensor from the learning rate)."""
        return self.rho

    def perturbs(self):
        """Whether any step perturbs (False: plain training, one pass)."""
        return self.rho > 0

    def adaptive_mask(self):
        """Which trainable variables ASAM scales by |w| + eta (all but biases)."""
        return [
            v.name.split("/")[-1] not in ASAM_UNSCALED_NAMES for v in self.model.trainable_variables
        ]

    # ------------------------------------------------------------------ the step

    def m_sharpness_groups(self):
        """Into how many groups the step splits its batch for m-sharpness: 1 without
        `m_sharpness`, and under a TensorFlow strategy (each replica's step already sees
        only its shard); on JAX under a `keras.distribution` (the step sees the global
        batch) the number of devices along the batch axis, one group per device's rows."""
        if not self.m_sharpness or F.num_replicas() > 1:
            return 1
        distribution = keras.distribution.distribution()
        axis = getattr(distribution, "batch_dim_name", None)
        if distribution is None or axis is None:
            return 1
        mesh = distribution.device_mesh
        names = list(mesh.axis_names)
        return int(mesh.shape[names.index(axis)]) if axis in names else 1

    def train_step(self, data):
        x, y, sample_weight = self.unpack(data)
        batch = (x, y, sample_weight)
        loss_scale = self.loss_scale()
        params = F.current_params(self.model)
        state = F.current_state(self.model)
        acc = F.accumulation_dtype(params)
        loss_fn = self.loss_fn(loss_scale=loss_scale)
        rho = self.current_rho()
        mask = self.adaptive_mask() if self.adaptive else None

        def step(batch, perturb):
            r = sam.sam_gradient(
                loss_fn,
                params,
                state,
                batch,
                rho=rho,
                adaptive=self.adaptive,
                eta=self.eta,
                adaptive_mask=mask,
                gsam_alpha=self.gsam_alpha(),
                perturb=perturb,
                gradient_scale=loss_scale,
                all_reduce=not self.m_sharpness,
            )
            on = ops.cast(perturb, acc) if not isinstance(perturb, bool) else float(perturb)
            return (
                r.gradient,
                r.loss,
                r.aux[1],
                r.aux[0],
                r.grad_norm,
                r.surrogate_gap,
                # ||g|| is measured on every step that runs this (a skipped step of
                # `every` measures nothing, on one replica as on several).
                F.scalar(1.0, acc) if isinstance(perturb, bool) else on,
                F.scalar(on, acc),
            )

        def plain(batch):
            # A step of `every > 1` that is not perturbed: one pass, no communication.
            loss, grads, (new_state, y_pred) = F.value_and_grad(loss_fn, params, state, batch)
            zero = F.scalar(0.0, acc)
            return grads, loss, y_pred, new_state, zero, zero, zero, zero

        groups = self.m_sharpness_groups()

        def run(fn):
            return fn(batch) if groups == 1 else _per_group(fn, batch, groups)

        if not self.perturbs():
            outputs = run(lambda b: step(b, False))
        elif self.every == 1:
            outputs = run(lambda b: step(b, True))
        else:
            outputs = self.schedule.cond(
                self.schedule.is_first(),
                lambda: run(lambda b: step(b, True)),
                lambda: run(plain),
                # The global perturbation all-reduces g: on several replicas every step
                # runs the clean pass and the all-reduce, and only the second pass is
                # conditional (inside sam_gradient). m-sharpness never communicates.
                communicates=not self.m_sharpness,
                merged=lambda perturb: step(batch, perturb),
            )
        gradient, loss, y_pred, new_state, grad_norm, gap, norm_weight, gap_weight = outputs
        loss = loss / ops.cast(loss_scale, loss.dtype)
        return self.finish_step(
            data,
            y_pred,
            loss,
            new_state=new_state,
            gradients=gradient,
            diagnostics={
                "grad_norm": (grad_norm, norm_weight),
                "surrogate_gap": (F.unscale_loss_for_distribution(gap), gap_weight),
                **self.step_diagnostics(rho),
            },
            where="the clean loss L(w)",
        )

    def step_diagnostics(self, rho):
        """Extra logged values of the step (GSAM: its rho)."""
        return {}

    def get_config(self):
        config = super().get_config()
        config.update(
            rho=self.rho,
            adaptive=self.adaptive,
            eta=self.eta,
            every=self.every,
            m_sharpness=self.m_sharpness,
        )
        return config


@keras.saving.register_keras_serializable(package="tf_metaalign")
class GSAMTrainer(SAMTrainer):
    """Train `model` with GSAM: SAM's perturbed gradient g_p, minus `alpha` times the
    part of the clean gradient g orthogonal to it, with rho following the learning rate.

    The direction handed to the optimizer (applied at w) is::

        g_perp = g - (g . g_p / ||g_p||^2) g_p
        d      = g_p - alpha * g_perp
        rho_t  = rho_min + (rho - rho_min) * (lr_t - lr_min) / (lr_max - lr_min)

    (big_vision's `gsam_gradient` with `minimize_fp=True`, the paper's Algorithm 1), where
    lr_t is the compiled optimizer's learning rate at the current step (its schedule
    evaluated at `optimizer.iterations`) and `(lr_min, lr_max) = learning_rate_range`.
    With `rho_min=None` (or equal to `rho`) rho is constant. `alpha=0` with a constant rho
    is SAM. Under several replicas the decomposition uses the global g and g_p (one more
    all-reduce, of g_p), or each replica's own with `m_sharpness=True` (big_vision's
    per-worker GSAM). Everything else (state, mixed precision, `every`, ASAM with
    `adaptive=True`) is as in `SAMTrainer`. Logs `rho` (the last step's) besides
    SAMTrainer's.

    Args:
      model: the Keras model to train.
      rho: rho_max (rho at the largest learning rate).
      alpha: GSAM's weight on the ascent along g_perp (the paper tunes 0.01 to 0.3;
        big_vision's ViT config 0.6).
      rho_min: rho at the smallest learning rate (None: constant rho).
      learning_rate_range: `(lr_min, lr_max)` of the learning-rate schedule; needed when
        rho_min differs from rho.
      adaptive: as `SAMTrainer` (ASAM's perturbation).
      eta: as `SAMTrainer`.
      every: as `SAMTrainer`.
      m_sharpness: as `SAMTrainer`.
      **kwargs: passed to `keras.Model`.

    Returns:
      A `keras.Model` to `compile` and `fit`.

    Example:
      >>> import keras, numpy as np
      >>> from tf_metaalign.trainers import GSAMTrainer
      >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
      >>> lr = keras.optimizers.schedules.PolynomialDecay(0.1, 4, end_learning_rate=0.01)
      >>> trainer = GSAMTrainer(model, rho=0.1, rho_min=0.01, alpha=0.1,
      ...                       learning_rate_range=(0.01, 0.1))
      >>> trainer.compile(optimizer=keras.optimizers.SGD(lr), loss="mse")
      >>> x, y = np.ones((8, 3), "float32"), np.ones((8, 1), "float32")
      >>> h = trainer.fit(x, y, batch_size=2, epochs=1, verbose=0)
      >>> round(float(h.history["rho"][-1]), 4)  # lr 0.0325 at the 4th step
      0.0325

    References:
      Zhuang et al., "Surrogate Gap Minimization Improves Sharpness-Aware Training",
      ICLR 2022; google-research/big_vision `trainers/proj/gsam`.
    """

    def __init__(
        self,
        model: keras.Model,
        rho: float = 0.05,
        alpha: float = 0.1,
        rho_min=None,
        learning_rate_range=None,
        adaptive: bool = False,
        eta: float = 0.01,
        every: int = 1,
        m_sharpness: bool = False,
        **kwargs,
    ):
        sam.validate_options(rho, adaptive, eta, every, alpha)
        if rho_min is not None:
            sam.validate_options(rho_min)
            if rho_min > rho:
                raise ValueError(f"`rho_min` must be <= `rho` ({rho}); got {rho_min!r}.")
        varying = rho_min is not None and float(rho_min) != float(rho)
        if learning_rate_range is not None:
            try:
                lr_min, lr_max = (float(v) for v in learning_rate_range)
            except (TypeError, ValueError):
                raise ValueError(
                    "`learning_rate_range` must be a pair (lr_min, lr_max) of numbers; "
                    f"got {learning_rate_range!r}."
                ) from None
            if not lr_max >= lr_min:
                raise ValueError(
                    f"`learning_rate_range` must be (lr_min, lr_max) with lr_min <= lr_max; "
                    f"got {learning_rate_range!r}."
                )
            learning_rate_range = (lr_min, lr_max)
        elif varying:
            raise ValueError(
                "`learning_rate_range` (lr_min, lr_max) is required when `rho_min` differs "
                "from `rho`: rho_t moves linearly with the learning rate between them."
            )
        super().__init__(
            model,
            rho=rho,
            adaptive=adaptive,
            eta=eta,
            every=every,
            m_sharpness=m_sharpness,
            **kwargs,
        )
        self.alpha = float(alpha)
        self.rho_min = None if rho_min is None else float(rho_min)
        self.learning_rate_range = learning_rate_range
        self.add_diagnostic("rho", "last")

    def gsam_alpha(self):
        return self.alpha

    def current_rho(self):
        if self.rho_min is None or self.rho_min == self.rho:
            return self.rho
        inner = getattr(self.optimizer, "inner_optimizer", self.optimizer)
        lr_min, lr_max = self.learning_rate_range
        return sam.gsam_rho(
            inner.learning_rate,
            self.rho,
            self.rho_min,
            lr_max=lr_max,
            lr_min=lr_min,
            dtype=F.accumulation_dtype(self.model.trainable_variables),
        )

    def step_diagnostics(self, rho):
        return {"rho": ops.cast(ops.convert_to_tensor(rho), "float32")}

    def get_config(self):
        config = super().get_config()
        config.update(
            alpha=self.alpha,
            rho_min=self.rho_min,
            learning_rate_range=(
                None if self.learning_rate_range is None else list(self.learning_rate_range)
            ),
        )
        return config


def _per_group(fn, batch, groups):
    """`fn` (a step on a batch -> `(gradient, loss, y_pred, new_state, *scalars)`) on each
    of `groups` consecutive equal slices of the batch, vectorized (`keras.ops.vectorized_map`:
    under a data-parallel sharding each device computes its own rows' step), combined as
    TensorFlow's optimizer and metrics combine its replicas': the mean gradient, loss and
    scalars, the outputs in row order, the mean of floating state (BatchNorm statistics)
    and the first group's other state (a seed: the same in every group)."""
    first = next(t for t in keras.tree.flatten(batch) if t is not None)
    rows = ops.shape(first)[0]
    if rows is None or rows % groups:
        raise ValueError(
            f"`m_sharpness=True` splits the batch into one group per device ({groups}): "
            f"the batch of {rows} rows is not a multiple of it. Batch the data with "
            "drop_remainder=True (or a batch size divisible by the devices)."
        )

    def split(t):
        return None if t is None else ops.reshape(t, (groups, rows // groups, *t.shape[1:]))

    def join(t):
        return ops.reshape(t, (rows, *t.shape[2:]))

    def mean(t):
        return ops.mean(t, axis=0)

    def combine_state(t):
        dtype = keras.backend.standardize_dtype(t.dtype)
        return ops.mean(t, axis=0) if "float" in dtype else t[0]

    out = ops.vectorized_map(fn, keras.tree.map_structure(split, batch))
    gradient, loss, y_pred, new_state, *scalars = out
    return (
        [mean(g) for g in gradient],
        mean(loss),
        keras.tree.map_structure(join, y_pred),
        [combine_state(t) for t in new_state],
        *[mean(v) for v in scalars],
    )
