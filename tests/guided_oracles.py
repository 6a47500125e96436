"""NumPy re-derivations of the paper's JAX code (google-research `gradient_based_tuning`
with flax <= 0.5's optimizers), for guided learning's tests on either backend (no
TensorFlow, no JAX: float64 NumPy only).

* `ref_sigmoid` / `ref_sigmoid_inverse`: guided_parameters_utils.activation_sig_fn /
  activation_sig_inverter with the guided_parameters.lamb_adam_beta1 config (steepness 1,
  floor 0, ceiling 1 - 1e-5); the learning-rate scale is activation_exp_fn (`np.exp`);
* `flax_adam` / `flax_lamb`: flax.optim.Adam and flax.optim.LAMB's `apply_param_gradient`;
* `ref_reduce`: train.py's guidance step: per device `nan_to_num(posinf=10, neginf=-10)`,
  then `pmean`, then (with --use_grad_clip) `clip(-limit, limit)`;
* `reference_trajectory`: the reference's guided training of y = x w + b (learning-rate
  scale and beta_1) with those pieces and a flax Adam meta step. Its hypergradient is a
  central difference of the guidance loss after one flax step (float64), so it shares
  nothing with the trainer's forward-mode derivation.
"""

import numpy as np

CEILING = 1.0 - 1e-5
N_TRAIN, N_GUIDE, STEPS, BASE_LR, META_LR = 16, 8, 4, 0.05, 0.01


def ref_sigmoid(raw):
    """activation_sig_fn(raw, steepness=1, ceiling=1 - 1e-5, floor=0)."""
    return (CEILING - 0.0) * (1.0 / (1.0 + np.exp(-1.0 * raw))) + 0.0


def ref_sigmoid_inverse(value):
    """activation_sig_inverter(value, steepness=1, ceiling=1 - 1e-5, floor=0)."""
    value = np.float64(value)
    with np.errstate(divide="ignore"):
        return float(np.clip(-np.log((CEILING - 0.0) / (value - 0.0) - 1.0), -500, 500))


def flax_adam(w, g, m, v, t, lr, b1=0.9, b2=0.999, eps=1e-8, wd=0.0):
    """flax.optim.Adam.apply_param_gradient, t the 1-based step."""
    m = b1 * m + (1.0 - b1) * g
    v = b2 * v + (1.0 - b2) * g * g
    m_hat, v_hat = m / (1 - b1**t), v / (1 - b2**t)
    new_w = w - lr * m_hat / (np.sqrt(v_hat) + eps)
    return new_w - lr * wd * w, m, v


def flax_lamb(w, g, m, v, t, lr, b1=0.9, b2=0.999, eps=1e-6, wd=0.0):
    """flax.optim.LAMB.apply_param_gradient."""
    m = b1 * m + (1.0 - b1) * g
    v = b2 * v + (1.0 - b2) * g * g
    u = (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
    if wd != 0.0:
        u = u + wd * w
    pn, un = np.linalg.norm(w), np.linalg.norm(u)
    ratio = pn / un if pn + un > 0 else 1.0
    return w - ratio * lr * u, m, v


def ref_reduce(local_values, clip=None):
    """train.py: nan_to_num per device, pmean, then the optional clip."""
    clean = [np.nan_to_num(x, posinf=10.0, neginf=-10.0) for x in local_values]
    h = float(np.mean(clean))
    return float(np.clip(h, -clip, clip)) if clip else h


def problem():
    """(x, y, x_guide, y_guide, w0, b0): a linear regression started near its solution."""
    rng = np.random.default_rng(3)
    w_true = rng.normal(size=(3,))
    x = rng.normal(size=(N_TRAIN + N_GUIDE, 3))
    y = x @ w_true + 0.05 * rng.normal(size=(N_TRAIN + N_GUIDE,))
    w0, b0 = w_true + 0.01 * rng.normal(size=(3,)), 0.3  # close: small gradients
    return x[:N_TRAIN], y[:N_TRAIN], x[N_TRAIN:], y[N_TRAIN:], w0, b0


def mse_and_grad(params, x, y):
    w, b = params
    r = x @ w + b - y
    return float(np.mean(r**2)), (2 * x.T @ r / len(y), 2 * np.mean(r))


def reference_trajectory(eps=1e-6, clip=None, model_rule=flax_adam):
    """The reference's guided training of y = x w + b (learning rate scale and beta_1):
    `(params, values, hypergradients per step)`."""
    x, y, xg, yg, w, b = problem()
    params = [np.array(w), np.array(b)]
    moments = [(np.zeros_like(p), np.zeros_like(p)) for p in params]
    raw = {"learning_rate": 0.0, "beta_1": ref_sigmoid_inverse(0.9)}
    meta = {k: (0.0, 0.0) for k in raw}
    hypergrads = []
    for t in range(1, STEPS + 1):
        _, grads = mse_and_grad(params, x, y)

        def step(r_lr, r_b1):
            lr, b1 = BASE_LR * np.exp(r_lr), ref_sigmoid(r_b1)
            out = [
                model_rule(p, g, m, v, float(t), lr, b1=b1, eps=eps)
                for p, g, (m, v) in zip(params, grads, moments)
            ]
            return [o[0] for o in out], [(o[1], o[2]) for o in out]

        def guide(r_lr, r_b1):
            return mse_and_grad(step(r_lr, r_b1)[0], xg, yg)[0]

        d = 1e-5
        h = {
            "learning_rate": (guide(raw["learning_rate"] + d, raw["beta_1"])
                              - guide(raw["learning_rate"] - d, raw["beta_1"])) / (2 * d),
            "beta_1": (guide(raw["learning_rate"], raw["beta_1"] + d)
                       - guide(raw["learning_rate"], raw["beta_1"] - d)) / (2 * d),
        }  # fmt: skip
        # An exactly zero derivative (beta_1 at LAMB's first step: m_hat = g whatever
        # beta_1, and the trust ratio normalises) leaves ~1e-11 of rounding in the central
        # difference, which flax's Adam would turn into a step of lr * h / (|h| + 1e-8).
        h = {k: ref_reduce([0.0 if abs(x) < 1e-9 else x], clip) for k, x in h.items()}
        hypergrads.append(h)  # as logged: sanitised and clipped
        params, moments = step(raw["learning_rate"], raw["beta_1"])
        for k in raw:
            g = h[k]
            new, m, v = flax_adam(np.array(raw[k]), g, *meta[k], float(t), META_LR)
            raw[k], meta[k] = float(new), (m, v)
    values = {"learning_rate": np.exp(raw["learning_rate"]), "beta_1": ref_sigmoid(raw["beta_1"])}
    return params, values, hypergrads
