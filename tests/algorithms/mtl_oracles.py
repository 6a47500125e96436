"""NumPy re-derivations of the multi-task references (LibMTL's `weighting/<Name>.py`,
tianheyu927/PCGrad, Cranial-XIX/FAMO, AvivNavon/nash-mtl, SamsungLabs/MTL), torch- and
TensorFlow-free, shared by the TensorFlow tests (test_gradient_surgery.py,
test_mtl_*.py) and the backend-neutral ones (test_multitask_methods_backends.py), so the
same oracles check both backends."""

import itertools

import numpy as np

F32_EPS = float(np.finfo(np.float32).eps)


# ------------------------------------------------- from test_gradient_surgery.py


def np_pcgrad(gs, order):
    """Yu et al. Algorithm 1: each g_i projected against the ORIGINAL g_j, j in order."""
    out = []
    for i in range(len(gs)):
        g = gs[i].copy()
        for j in order:
            if j == i:
                continue
            d = g @ gs[j]
            if d < 0 and gs[j] @ gs[j] > 0:
                g = g - d / (gs[j] @ gs[j]) * gs[j]
        out.append(g)
    return np.sum(out, axis=0)


def np_gradvac(gs, targets, order, beta):
    """LibMTL GradVac (global): the EMA target of (i, j) updated after its use."""
    targets = targets.copy()
    out = []
    for i in range(len(gs)):
        g = gs[i].copy()
        for j in order:
            ni, nj = np.linalg.norm(g), np.linalg.norm(gs[j])
            if j == i or ni == 0 or nj == 0:
                continue
            rho = g @ gs[j] / (ni * nj)
            t = targets[i, j]
            if rho < t:
                w = (
                    ni
                    * (t * np.sqrt(1 - rho**2) - rho * np.sqrt(1 - t**2))
                    / (nj * np.sqrt(1 - t**2))
                )
                g = g + w * gs[j]
            targets[i, j] = (1 - beta) * t + beta * rho
        out.append(g)
    return np.sum(out, axis=0), targets


def np_gradnorm(weights, layer_norms, losses, initial, present, alpha, lr):
    """Chen et al. 2018, Algorithm 1, one step on the weights (target a constant)."""
    p = present.astype(bool)
    G = weights * layer_norms
    G_bar = G[p].mean()
    ratio = losses / np.where(initial == 0, 1, initial)
    r = ratio / ratio[p].mean()
    target = G_bar * r**alpha
    grad = np.where(p, np.sign(G - target) * layer_norms, 0.0)
    new = weights - lr * grad
    return new * len(weights) / new.sum()


# ------------------------------------------------- from test_mtl_solvers.py


def np_min_norm_element_from2(v1v1, v1v2, v2v2, ends=(1.0, 0.0)):
    """LibMTL `_min_norm_element_from2`; LibMTL's ends are (0.999, 0.001)."""
    if v1v2 >= v1v1:
        return ends[0], v1v1
    if v1v2 >= v2v2:
        return ends[1], v2v2
    gamma = -1.0 * ((v1v2 - v2v2) / (v1v1 + v2v2 - 2 * v1v2))
    return gamma, v2v2 + gamma * (v1v2 - v2v2)


def np_projection2simplex(y):
    m = len(y)
    sorted_y = np.sort(y)[::-1]
    tmpsum = 0.0
    tmax_f = (np.sum(y) - 1.0) / m
    for i in range(m - 1):
        tmpsum += sorted_y[i]
        tmax = (tmpsum - 1) / (i + 1.0)
        if tmax > sorted_y[i + 1]:
            tmax_f = tmax
            break
    return np.maximum(y - tmax_f, 0.0)


def np_next_point(cur_val, grad, n):
    proj_grad = grad - (np.sum(grad) / n)
    tm1 = -1.0 * cur_val[proj_grad < 0] / proj_grad[proj_grad < 0]
    tm2 = (1.0 - cur_val[proj_grad > 0]) / (proj_grad[proj_grad > 0])
    t = 1.0
    if (tm1 > 1e-7).sum() > 0:
        t = np.min(tm1[tm1 > 1e-7])
    if (tm2 > 1e-7).sum() > 0:
        t = min(t, np.min(tm2[tm2 > 1e-7]))
    return np_projection2simplex(proj_grad * t + cur_val)


def np_find_min_norm_element(grad_mat, ends=(1.0, 0.0), max_iter=250, stop_crit=1e-5):
    """LibMTL `MGDA._find_min_norm_element` on the Gram matrix (it only uses grads @ grads.T)."""
    n = grad_mat.shape[0]
    if n == 1:
        return np.ones(1)
    dmin = 1e8
    for i in range(n):
        for j in range(i + 1, n):
            c, d = np_min_norm_element_from2(grad_mat[i, i], grad_mat[i, j], grad_mat[j, j], ends)
            if d < dmin:
                dmin = d
                sol = [(i, j), c, d]
    sol_vec = np.zeros(n)
    sol_vec[sol[0][0]] = sol[1]
    sol_vec[sol[0][1]] = 1 - sol[1]
    if n < 3:
        return sol_vec
    for _ in range(max_iter):
        grad_dir = -1.0 * grad_mat @ sol_vec
        new_point = np_next_point(sol_vec, grad_dir, n)
        v1v1 = sol_vec @ grad_mat @ sol_vec
        v1v2 = sol_vec @ grad_mat @ new_point
        v2v2 = new_point @ grad_mat @ new_point
        nc, _ = np_min_norm_element_from2(v1v1, v1v2, v2v2, ends)
        new_sol_vec = nc * sol_vec + (1 - nc) * new_point
        if np.sum(np.abs(new_sol_vec - sol_vec)) < stop_crit:
            return sol_vec
        sol_vec = new_sol_vec
    return sol_vec


def np_libmtl_mgda(grads, losses, mgda_gn, ends=(1.0, 0.0), **solver):
    """LibMTL `MGDA.backward` (rep_grad=False): the new shared gradient."""
    if mgda_gn == "l2":
        gn = np.sqrt((grads**2).sum(-1))
    elif mgda_gn == "loss":
        gn = losses
    elif mgda_gn == "loss+":
        gn = losses * np.sqrt((grads**2).sum(-1))
    else:
        gn = np.ones_like(losses)
    grads = grads / gn[:, None]
    sol = np_find_min_norm_element(grads @ grads.T, ends, **solver)
    return (sol[:, None] * grads).sum(0), sol


def np_enumerate_dual(gram, gb, c):
    """min over the simplex of  w.gb + c sqrt(w^T G w)  by enumerating every face in
    NumPy (np.linalg.pinv): each face's stationary point in its affine hull in closed
    form, kept if its weights are >= -1e-10; the best objective wins. gb = 0, c = 1 is
    the min-norm point."""
    T = gram.shape[0]
    best, best_w = np.inf, None
    for k in range(1, T + 1):
        for face in itertools.combinations(range(T), k):
            i0, rest = face[0], list(face[1:])
            w = np.zeros(T)
            if not rest:
                w[i0] = 1.0
            else:
                m = (
                    gram[np.ix_(rest, rest)]
                    - gram[rest][:, [i0]]
                    - gram[[i0]][:, rest]
                    + gram[i0, i0]
                )
                r = gram[rest, i0] - gram[i0, i0]
                q = gb[rest] - gb[i0]
                mp = np.linalg.pinv(m, rcond=1e-13)
                s2 = q @ mp @ q / c**2
                if s2 >= 1:
                    continue
                p2 = max(gram[i0, i0] - r @ mp @ r, 0.0)
                z = -mp @ r - np.sqrt(p2 / (1 - s2)) / c * (mp @ q)
                w[rest] = z
                w[i0] = 1 - z.sum()
                if w.min() < -1e-10:
                    continue
                w = np.maximum(w, 0)
                w /= w.sum()
            value = w @ gb + c * np.sqrt(max(w @ gram @ w, 0.0))
            if value < best:
                best, best_w = value, w
    return best_w


def np_libmtl_cagrad(grads, calpha=0.5, rescale=1, w=None):
    """LibMTL `CAGrad.backward` (NumPy): its SLSQP call (scipy, as LibMTL) unless the dual
    weights `w` are given. Returns (new shared gradient, w)."""
    from scipy.optimize import minimize

    T = grads.shape[0]
    GG = grads @ grads.T
    g0_norm = np.sqrt(GG.mean() + 1e-8)
    x_start = np.ones(T) / T
    A, b = GG, x_start.copy()
    c = calpha * g0_norm + 1e-8
    if w is None:

        def objfn(x):
            return (
                x.reshape(1, -1).dot(A).dot(b.reshape(-1, 1))
                + c * np.sqrt(x.reshape(1, -1).dot(A).dot(x.reshape(-1, 1)) + 1e-8)
            ).sum()

        res = minimize(
            objfn,
            x_start,
            bounds=tuple((0, 1) for _ in x_start),
            constraints=({"type": "eq", "fun": lambda x: 1 - sum(x)},),
        )
        w = res.x
    gw = (grads * w[:, None]).sum(0)
    lmbda = c / (np.linalg.norm(gw) + 1e-8)
    g = grads.mean(0) + lmbda * gw
    return g / {0: 1.0, 1: 1 + calpha**2, 2: 1 + calpha}[rescale], w


def np_cagrad_exact_w(grads, calpha=0.5):
    T = grads.shape[0]
    gram = grads @ grads.T
    c = calpha * np.sqrt(gram.mean() + 1e-8) + 1e-8
    return np_enumerate_dual(gram, gram @ np.full(T, 1.0 / T), c)


def np_libmtl_imtl(grads, losses, loss_scale):
    """LibMTL `IMTL.backward` (NumPy; rep_grad=False): the per-task losses are
    exp(s) L - s, so their gradients are exp(s) g on the model and exp(s) L - 1 on s.
    Returns (new shared gradient, alpha, task-specific factors, gradient of s)."""
    scale = np.exp(loss_scale)
    grads = grads * scale[:, None]
    T = grads.shape[0]
    grads_unit = grads / np.linalg.norm(grads, axis=-1, keepdims=True)
    D = np.repeat(grads[0:1], T - 1, 0) - grads[1:]
    U = np.repeat(grads_unit[0:1], T - 1, 0) - grads_unit[1:]
    alpha = grads[0] @ U.T @ np.linalg.inv(D @ U.T)
    alpha = np.concatenate([[1 - alpha.sum()], alpha])
    return (alpha[:, None] * grads).sum(0), alpha, scale, scale * losses - 1.0


# ------------------------------------------------- from test_mtl_nash_aligned.py


def numpy_nash(M, iters=200):
    """Nash bargaining point by plain Newton with a backtracking line search on
    f = 1/2 a^T M a - sum log a (unscaled variables, its own start at ones)."""
    T = len(M)
    a = np.ones(T)

    def f(x):
        return 0.5 * x @ M @ x - np.sum(np.log(x))

    for _ in range(iters):
        g = M @ a - 1.0 / a
        H = M + np.diag(1.0 / a**2)
        d = -np.linalg.solve(H, g)
        t = 1.0
        while np.any(a + t * d <= 0) or f(a + t * d) > f(a) + 0.25 * t * (g @ d):
            t *= 0.5
            if t < 1e-30:
                break
        a = a + t * d
    return a


def coordinate_descent_nash(M, sweeps=3000):
    """Brute force: exact coordinate minimisation of f (each a root of a quadratic:
    M_ii a_i^2 + (sum_{j!=i} M_ij a_j) a_i - 1 = 0), swept to convergence."""
    a = 1.0 / np.sqrt(np.diag(M))
    for _ in range(sweeps):
        for i in range(len(M)):
            b = M[i] @ a - M[i, i] * a[i]
            a[i] = (-b + np.sqrt(b * b + 4.0 * M[i, i])) / (2.0 * M[i, i])
    return a


def libmtl_nash_numpy(G, present, max_norm=1.0):
    """LibMTL Nash_MTL.backward, torch-free, with the bargaining point as the solver's
    answer: weights alpha; the shared gradient sum alpha_t g_t clipped by torch's
    clip_grad_norm_ (factor min(1, max_norm / (norm + 1e-6))), heads get alpha_t g_t."""
    idx = np.flatnonzero(present)
    alpha = np.zeros(len(G))
    Gp = G[idx]
    alpha[idx] = numpy_nash(Gp @ Gp.T)
    shared = G.T @ alpha
    if max_norm > 0:
        norm = np.linalg.norm(shared)
        shared = shared * min(1.0, max_norm / (norm + 1e-6))
    return alpha, shared


def libmtl_aligned_numpy(G):
    """LibMTL Aligned_MTL.backward, torch-free (torch.finfo() = float32's eps)."""
    M = G @ G.T
    lmbda, V = np.linalg.eigh(M)
    tol = np.max(lmbda) * max(M.shape) * F32_EPS
    rank = int(np.sum(lmbda > tol))
    order = np.argsort(-lmbda)
    lmbda, V = lmbda[order][:rank], V[:, order][:, :rank]
    sigma = np.diag(1 / np.sqrt(lmbda))
    B = np.sqrt(lmbda[-1]) * ((V @ sigma) @ V.T)
    return B.sum(0)


def official_procrustes_numpy(G, scale_mode="min"):
    """SamsungLabs/MTL ProcrustesSolver.apply + AlignedMTLBalancer.step: the summed
    aligned gradient and the weights W.sum(-1)."""
    grads = G.T[None]  # [1, D, T]
    cov = (np.transpose(grads, (0, 2, 1)) @ grads).mean(0)
    singulars, basis = np.linalg.eigh(cov)
    tol = np.max(singulars) * max(cov.shape) * F32_EPS
    rank = int(np.sum(singulars > tol))
    order = np.argsort(-singulars)
    singulars, basis = singulars[order][:rank], basis[:, order][:, :rank]
    if scale_mode == "min":
        weights = basis * np.sqrt(singulars[-1])
    elif scale_mode == "median":
        weights = basis * np.sqrt(np.sort(singulars)[(len(singulars) - 1) // 2])  # torch
    else:
        weights = basis * np.sqrt(singulars.mean())
    weights = weights / np.sqrt(singulars)[None]
    weights = weights @ basis.T
    aligned = grads @ weights[None]
    return aligned[0].sum(-1), weights.sum(-1)


# ------------------------------------------------- from test_mtl_weighting.py


class LibMTLUW:
    """LibMTL `UW` (NumPy): loss = sum(L / (2 exp(s)) + s / 2), s a model parameter
    trained by the model's optimizer (plain SGD here), returned weights 1/(2 exp(s))."""

    def __init__(self, num_tasks):
        self.loss_scale = np.full(num_tasks, -0.5)

    def backward(self, losses, present):
        s = self.loss_scale
        loss = np.sum(present * (losses / (2 * np.exp(s)) + s / 2))
        # the reference's autograd: d loss / d s_t = present_t (1/2 - L_t / (2 exp(s_t))),
        # checked against central differences
        grad = present * (0.5 - losses / (2 * np.exp(s)))
        h = 1e-6
        numeric = np.array(
            [
                (
                    np.sum(present * (losses / (2 * np.exp(s + h * e)) + (s + h * e) / 2))
                    - np.sum(present * (losses / (2 * np.exp(s - h * e)) + (s - h * e) / 2))
                )
                / (2 * h)
                for e in np.eye(len(s))
            ]
        )
        np.testing.assert_allclose(grad, numeric, rtol=1e-7, atol=1e-9)
        return present / (2 * np.exp(s)), loss, grad


def libmtl_dwa(epoch_losses, num_tasks, temperature=2.0):
    """LibMTL `DWA` driven by LibMTL's trainer (NumPy): epoch_losses[e] is the list of
    per-batch loss vectors of epoch e; train_loss_buffer[:, e] is written at the end of
    epoch e (the meter's average: equal batch sizes); returns each batch's weights."""
    buffer = np.zeros([num_tasks, len(epoch_losses)])
    out = []
    for epoch, batches in enumerate(epoch_losses):
        for _ in batches:
            if epoch > 1:
                w_i = buffer[:, epoch - 1] / buffer[:, epoch - 2]
                e = np.exp(w_i / temperature - np.max(w_i / temperature))
                out.append(num_tasks * e / e.sum())
            else:
                out.append(np.ones(num_tasks))
        buffer[:, epoch] = np.mean(batches, axis=0)
    return out


class TorchAdam:
    """torch.optim.Adam (L2 weight_decay added to the gradient, bias-corrected)."""

    def __init__(self, lr, weight_decay, betas=(0.9, 0.999), eps=1e-8):
        self.lr, self.wd, self.betas, self.eps = lr, weight_decay, betas, eps
        self.m = self.v = None
        self.t = 0

    def step(self, param, grad):
        b1, b2 = self.betas
        if self.m is None:
            self.m, self.v = np.zeros_like(param), np.zeros_like(param)
        self.t += 1
        grad = grad + self.wd * param
        self.m = b1 * self.m + (1 - b1) * grad
        self.v = b2 * self.v + (1 - b2) * grad * grad
        denom = np.sqrt(self.v) / np.sqrt(1 - b2**self.t) + self.eps
        return param - (self.lr / (1 - b1**self.t)) * self.m / denom


class ReferenceFAMO:
    """Cranial-XIX/FAMO `FAMO` / LibMTL `FAMO` (NumPy). `backward` returns the gradient
    of the reference's loss sum(log(D) z / c) with respect to the losses (c, z
    detached), i.e. the weights the model's gradient gets; `update_w` is the reference's
    logits step (J_softmax(w)^T delta, one Adam step)."""

    def __init__(self, num_tasks, w_lr=0.025, gamma=1e-3, min_losses=0.0):
        self.w = np.zeros(num_tasks)
        self.opt = TorchAdam(w_lr, gamma)
        self.min_losses = np.broadcast_to(np.asarray(min_losses, float), (num_tasks,))

    def backward(self, losses):
        self.prev_losses = losses
        z = np.exp(self.w) / np.exp(self.w).sum()
        D = losses - self.min_losses + 1e-8
        c = np.sum(z / D)
        # d/dL_t sum_s log(D_s) z_s / c = z_t / (c D_t)
        return z / (c * D)

    def update_w(self, curr_losses):
        delta = np.log(self.prev_losses - self.min_losses + 1e-8) - np.log(
            curr_losses - self.min_losses + 1e-8
        )
        z = np.exp(self.w) / np.exp(self.w).sum()
        jacobian = np.diag(z) - np.outer(z, z)  # d softmax_i / d w_j
        self.w = self.opt.step(self.w, jacobian.T @ delta)
