"""GPTQ (Frantar et al., 2022, "GPTQ: Accurate Post-Training Quantization for Generative
Pre-trained Transformers") as pure functions on tensors.

The layer objective is the output error on the calibration inputs ``X`` (N, in)::

    min_Q || X W^T - X Q^T ||^2 = tr((W - Q) H (W - Q)^T),    H = X^T X   (in, in)

Columns are quantized one at a time; the rounding error of column ``i`` is pushed onto the
columns not yet quantized through the inverse Hessian (eq. 3 of the paper, in the Cholesky
form of section 3.3)::

    err = (w_i - q_i) / U_ii          W[:, j] -= err * U_ij   for j > i,   U = chol(H^-1)^T

Updates are applied lazily in blocks of ``block_size`` columns (section 3.2). No hooks, no
I/O: ``accumulate_hessian`` and ``gptq_quantize`` are all there is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from optkit.errors import QuantizationError
from optkit.quantize.observers import Observer, minmax_observer
from optkit.quantize.rtn import QuantizedWeight
from optkit.quantize.scheme import QuantScheme

#: Each Cholesky failure multiplies the dampening by this, at most this many times.
DAMP_RETRY_FACTOR = 10.0
MAX_DAMP_RETRIES = 4


@dataclass(frozen=True)
class GPTQResult:
    """``weight``: the quantized weight; ``damp``: the dampening fraction finally used (larger
    than asked when the Cholesky factorization failed and was retried; ``retries`` says how often)."""

    weight: QuantizedWeight
    damp: float
    retries: int


def accumulate_hessian(H: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """``H += X^T X`` over the tokens of ``x`` (..., in), in float32. Starts from zeros when
    ``H`` is None. The sum is not normalized: GPTQ is invariant to the scale of ``H``."""
    x2 = x.reshape(-1, x.shape[-1]).float()  # (N, in)
    if H is None:
        H = torch.zeros(x2.shape[1], x2.shape[1], dtype=torch.float32, device=x2.device)
    H.addmm_(x2.T, x2)
    return H


def inverse_hessian_cholesky(H: torch.Tensor, damp: float) -> tuple[torch.Tensor, float, int]:
    """Upper Cholesky factor of ``(H + damp * mean(diag H) * I)^-1``.

    A failed factorization (H not positive definite in float32) is retried with the dampening
    multiplied by ``DAMP_RETRY_FACTOR``. Returns ``(U, damp_used, retries)``.
    """
    n = H.shape[0]
    mean_diag = float(torch.diag(H).mean())
    if not mean_diag > 0:
        mean_diag = 1.0
    eye = torch.eye(n, dtype=H.dtype, device=H.device)
    d = damp
    for attempt in range(MAX_DAMP_RETRIES + 1):
        L, info = torch.linalg.cholesky_ex(H + d * mean_diag * eye)
        if int(info) == 0:
            U, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(L), upper=True)
            if int(info) == 0 and torch.isfinite(U).all():
                return U, d, attempt
        d *= DAMP_RETRY_FACTOR
    raise QuantizationError(
        f"the Hessian is not positive definite even with dampening {d / DAMP_RETRY_FACTOR:g} "
        f"(started at {damp:g}, {MAX_DAMP_RETRIES} retries)",
        hint="raise quantization.gptq.damp or use more calibration tokens",
    )


def _quantize_column(w: torch.Tensor, s: torch.Tensor, z: torch.Tensor | None, scheme: QuantScheme):
    """One column (out,) against its group's scale/zero point (out,): (codes, dequantized)."""
    q = torch.round(w / s)
    if z is not None:
        q = torch.clamp(q + z, scheme.qmin, scheme.qmax)
        return q, (q - z) * s
    q = torch.clamp(q, scheme.qmin, scheme.qmax)
    return q, q * s


def gptq_quantize(
    W: torch.Tensor,
    H: torch.Tensor,
    scheme: QuantScheme,
    scale_dtype: torch.dtype,
    *,
    damp: float = 0.01,
    block_size: int = 128,
    act_order: bool = False,
    observer: Observer = minmax_observer,
    importance: torch.Tensor | None = None,
) -> GPTQResult:
    """Quantize ``W`` (out, in) given ``H = X^T X`` (in, in) of its calibration inputs.

    Group scales are chosen by ``observer`` (with ``importance`` (in,), if given) when the
    first column of the group is reached, from the columns as updated so far. With
    ``act_order`` columns go in order of decreasing ``diag(H)`` and the groups are static:
    every scale is computed up front from the original weights, in the original column
    order, so the stored layout is the same as without act-order.
    """
    out_f, in_f = W.shape
    if H.shape != (in_f, in_f):
        raise ValueError(f"H must be ({in_f}, {in_f}) for W of shape {tuple(W.shape)}, got {tuple(H.shape)}")
    if not scheme.fits(in_f):
        raise ValueError(f"in_features {in_f} is not divisible by group_size {scheme.group_size}")
    g = in_f if scheme.group_size is None else scheme.group_size
    n_groups = in_f // g
    W = W.detach().float().clone()  # (out, in), updated in place as errors are pushed forward
    H = H.detach().float().clone()
    dead = torch.diag(H) == 0  # inputs never active: keep H invertible, their columns carry no error
    H[dead, dead] = 1.0

    scale = torch.empty(out_f, n_groups, dtype=scale_dtype)
    zero = None if scheme.symmetric else torch.empty(out_f, n_groups, dtype=torch.int8)
    static = scheme.group_size is None or act_order
    if static:  # all scales from the original weights (per channel: one group = the whole row)
        scale, zero = observer(W, scheme, scale_dtype, importance)
    scale_f = scale.float()  # float32 copies read column by column in the loop below
    zero_f = None if zero is None else zero.float()

    perm = torch.argsort(torch.diag(H), descending=True) if act_order else torch.arange(in_f)
    W = W[:, perm]
    H = H[perm][:, perm]
    U, damp_used, retries = inverse_hessian_cholesky(H, damp)

    # Group boundaries must not fall inside a lazy block where the group's columns have
    # pending updates, so the block is a multiple of the group (when not static).
    B = block_size if static else max(g, block_size // g * g)
    Q = torch.empty(out_f, in_f, dtype=torch.float32)  # codes, permuted order
    for i1 in range(0, in_f, B):
        i2 = min(i1 + B, in_f)
        W1 = W[:, i1:i2].clone()  # (out, b)
        U1 = U[i1:i2, i1:i2]  # (b, b)
        Err1 = torch.empty_like(W1)
        for i in range(i2 - i1):
            col = int(perm[i1 + i])  # original column index
            gi = col // g
            if not static and col % g == 0:  # first column of a group: its columns are W1[:, i:i+g]
                imp = None if importance is None else importance[col : col + g]
                s_, z_ = observer(W1[:, i : i + g], QuantScheme(scheme.bits, g, scheme.symmetric), scale_dtype, imp)
                scale[:, gi] = s_[:, 0]
                scale_f[:, gi] = s_[:, 0].float()
                if zero is not None:
                    zero[:, gi] = z_[:, 0]
                    zero_f[:, gi] = z_[:, 0].float()
            s = scale_f[:, gi]
            z = None if zero_f is None else zero_f[:, gi]
            w = W1[:, i]
            q, deq = _quantize_column(w, s, z, scheme)
            Q[:, i1 + i] = q
            err = (w - deq) / U1[i, i]  # (out,)
            W1[:, i:] -= err.unsqueeze(1) * U1[i, i:].unsqueeze(0)
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ U[i1:i2, i2:]  # lazy batch update of the columns after the block

    codes = torch.empty_like(Q)
    codes[:, perm] = Q
    qw = QuantizedWeight(codes.to(torch.int8), scale.contiguous(), None if zero is None else zero.contiguous(), scheme)
    return GPTQResult(qw, damp_used, retries)


def output_error(W: torch.Tensor, W_hat: torch.Tensor, H: torch.Tensor) -> float:
    """Relative output error on the calibration inputs: ``tr(dW H dW^T) / tr(W H W^T)``."""
    dW = (W.float() - W_hat.float())  # (out, in)
    num = float(((dW @ H) * dW).sum())
    den = float(((W.float() @ H) * W.float()).sum())
    return num / den if den > 0 else 0.0


def refine_scales(W: torch.Tensor, qw: QuantizedWeight, H: torch.Tensor, ridge: float = 1e-6) -> QuantizedWeight:
    """Least-squares scales for fixed integer codes: per row ``r``, the group scales ``s`` minimize
    the output error ``(w_r - sum_g s_g c_rg) H (w_r - sum_g s_g c_rg)^T``, where ``c_rg`` holds
    the row's codes (minus zero points) in group ``g`` and zeros elsewhere. The normal equations
    ``A_r s = b_r`` are G x G per row::

        A_r[g, h] = c_rg H c_rh^T        b_r[g] = c_rg H w_r^T

    GPTQ picks each group's scale before it knows how its codes will come out; refitting the
    scales afterwards can only lower the calibration error (up to the rounding of the scales to
    their storage dtype). A scale that would come out non-positive keeps its old value.
    """
    scheme = qw.scheme
    out_f, in_f = W.shape
    g = in_f if scheme.group_size is None else scheme.group_size
    G = in_f // g
    C = qw.q.float()
    if qw.zero_point is not None:
        C = C - qw.zero_point.float().repeat_interleave(g, dim=1)
    C3 = C.reshape(out_f, G, g)  # (out, G, g)
    H = H.float()
    Y = torch.einsum("ihj,rhj->rih", H.reshape(in_f, G, g), C3)  # (out, in, G): (H c_rh^T)_i
    A = torch.einsum("rgi,rgih->rgh", C3, Y.reshape(out_f, G, g, G))  # (out, G, G)
    b = (C3 * (W.float() @ H).reshape(out_f, G, g)).sum(-1)  # (out, G)
    diag = torch.diagonal(A, dim1=-2, dim2=-1)
    A = A + torch.diag_embed(ridge * diag.clamp(min=1e-12))
    s_new = torch.linalg.solve(A, b.unsqueeze(-1)).squeeze(-1)  # (out, G)
    old = qw.scale.float()
    ok = torch.isfinite(s_new) & (s_new > 0) & (diag > 0)
    scale = torch.where(ok, s_new, old).to(qw.scale.dtype)
    finfo = torch.finfo(qw.scale.dtype)
    scale = scale.clamp(min=finfo.tiny, max=finfo.max)
    refined = QuantizedWeight(qw.q, scale, qw.zero_point, scheme)
    # Rounding the scales to a 16-bit dtype can, rarely, undo the gain: keep whichever is better.
    if output_error(W, refined.dequantize(), H) <= output_error(W, qw.dequantize(), H):
        return refined
    return qw


def correct_for_input_error(W: torch.Tensor, H: torch.Tensor, D: torch.Tensor, alpha: float, damp: float = 0.01) -> torch.Tensor:
    """The weight that best maps the quantized model's inputs ``X'`` to the float model's outputs
    ``X W^T`` (asymmetric calibration, as in GPTAQ / QEP), moved a fraction ``alpha`` of the way::

        min_V || X' V^T - X W^T ||^2   =>   V = W + W D H^-1,   D = (X - X')^T X',  H = X'^T X'

    Then ``|| X W^T - X' Q^T ||^2 = const + || (V - Q) X'^T ||^2``, so GPTQ on ``V`` with ``H``
    minimizes the error against the float model itself, upstream quantization error included.
    ``H`` is dampened like GPTQ's (``damp`` x mean diagonal) before it is inverted.
    """
    n = H.shape[0]
    Hd = H.float() + damp * float(torch.diag(H).mean()) * torch.eye(n, dtype=torch.float32)
    L, info = torch.linalg.cholesky_ex(Hd)
    if int(info) != 0:
        return W.float().clone()  # not positive definite: no correction rather than a wild one
    WD = W.float() @ D.float()  # (out, in)
    corr = torch.cholesky_solve(WD.T, L).T  # W D H^-1 (H symmetric)
    return W.float() + alpha * corr
