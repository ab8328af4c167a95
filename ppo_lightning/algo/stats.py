"""Masked statistics over response tokens, as pure tensor functions (no Lightning, no models):
sums, means and variances over the positions a mask selects, whitening, explained variance.

Shapes: ``B`` rows (episodes), ``R`` response positions. Every function takes a ``mask`` that is 1
on real response tokens and 0 on prompt, pad and after-EOS positions; statistics are taken over
masked positions only. With ``distributed=True`` a statistic is taken over every rank's tokens.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

Tensor = torch.Tensor


def _all_reduce_sum(*xs: Tensor) -> tuple[Tensor, ...]:
    """Sum tensors across ranks when a process group is up (DDP); identity otherwise."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return xs
    flat = torch.stack([x.detach().to(torch.float64) for x in xs])
    dist.all_reduce(flat)
    return tuple(flat.to(xs[0].dtype).unbind(0))


def _select(x: Tensor, mask: Tensor) -> Tensor:
    """``x`` where ``mask`` is 1, else 0: selected, not multiplied, so an inf or NaN at a masked
    position (an overflowing ratio on a pad token) cannot leak into a statistic."""
    return torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    return _select(x, mask).sum() if dim is None else _select(x, mask).sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over positions where ``mask`` is 1 (0 if the mask is empty)."""
    if dim is None:
        return _select(x, mask).sum() / mask.sum().clamp(min=1)
    return _select(x, mask).sum(dim) / mask.sum(dim).clamp(min=1)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True, distributed: bool = False) -> Tensor:
    """Variance of ``x`` over masked positions (Bessel-corrected by default, as the tutorial does).

    With ``distributed=True`` the sums are all-reduced, giving the statistic over every rank's
    batch: each rank then whitens with the same mean and std ([N+] "statistics across ranks").
    """
    mean, _, n = _masked_moments(x, mask, distributed)
    var = _masked_moments((x - mean) ** 2, mask, distributed)[0]
    if unbiased and n > 1:  # Bessel's correction; a single element has variance 0 either way
        var = var * n / (n - 1)
    return var


def _masked_moments(x: Tensor, mask: Tensor, distributed: bool) -> tuple[Tensor, Tensor, Tensor]:
    s, n = masked_sum(x, mask), mask.sum().to(x.dtype)
    if distributed:
        s, n = _all_reduce_sum(s, n)
    return s / n.clamp(min=1), s, n


def whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, distributed: bool = False) -> Tensor:
    """Normalise ``x`` to mean 0 / std 1 over masked positions; masked-out positions become 0.

    Advantages are whitened over response tokens only ([N+] detail: prompt and pad positions
    would otherwise drag the statistics). ``shift_mean=False`` keeps the mean (used for reward
    whitening, where the sign of the reward carries information).
    """
    mean = _masked_moments(x, mask, distributed)[0]
    var = masked_var(x, mask, distributed=distributed)
    whitened = (x - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """1 - Var[returns - values] / Var[returns] over masked tokens: 1 is perfect, <= 0 is useless."""
    var_y = masked_var(returns, mask, unbiased=False)
    return 1.0 - masked_var(returns - values, mask, unbiased=False) / var_y.clamp(min=1e-8)
