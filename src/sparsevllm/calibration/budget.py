"""The `auto` budget rule: the smallest calibrated budget whose accuracy meets a floor.

A calibration point says: at prompt length L, keeping a fraction f of the prompt gave
this fraction of vanilla's accuracy. For a floor a and a prompt of n tokens:

1. At each measured length L, the feasible fraction f_L(a) is the smallest measured f
   such that every point at L with a kept fraction >= f meets a (None when the largest
   measured fraction already misses it). Requiring every larger fraction to pass makes
   the choice monotone on a noisy curve: a dip at a larger fraction is not jumped over.
2. The lengths that speak for n: the nearest measured length at or below n and the
   nearest one whose prompts reach n; f = the larger of their f_L (the stricter one).
   A prompt longer than every measured length covers gets None: the calibration says
   nothing about it.
3. budget = ceil(f * max(n, L_min)): a prompt shorter than the shortest measured length
   keeps at least the tokens that length was measured with, never fewer.
4. A budget that covers the whole prompt is None (keep the full context).

A stricter floor never gives a smaller budget: each step is monotone in a (None counts
as the full context, larger than any budget).
"""

from __future__ import annotations

import math

from sparsevllm.calibration.schema import Calibration, MethodCurve, Point


def feasible_fraction(points: list[Point], min_accuracy: float) -> float | None:
    """The smallest kept fraction whose every point at or above it meets the floor."""
    best = None
    for fraction in sorted({p.kept_fraction for p in points}, reverse=True):
        if any(p.relative_accuracy < min_accuracy for p in points if p.kept_fraction == fraction):
            break
        best = fraction
    return best


def lengths_for(curve: MethodCurve, prompt_len: int) -> list[int] | None:
    """The measured lengths that speak for a prompt of `prompt_len` tokens (None:
    longer than every measured length covers)."""
    below = [c.length for c in curve.lengths if c.length <= prompt_len]
    reach = [c.length for c in curve.lengths if c.max_prompt_tokens >= prompt_len]
    if not reach:
        return None
    return sorted({*below[-1:], reach[0]})


def choose_budget(
    calibration: Calibration, method: str, min_accuracy: float, prompt_len: int
) -> int | None:
    """The smallest budget (KV tokens per layer: the unit of every method's budget knob,
    which `sparse.registry.budget_overrides(method, budget)` maps onto its settings)
    whose calibrated accuracy for `method` is at least `min_accuracy` of vanilla's on a
    prompt of `prompt_len` tokens; None: the calibration cannot promise that with less
    than the full context, so keep it all. ValueError: a floor outside [0, 1], a prompt
    length below 1, or a method the calibration has no points for."""
    if isinstance(min_accuracy, bool) or not isinstance(min_accuracy, (int, float)):
        raise ValueError(f"min_accuracy must be a number in [0, 1], got {min_accuracy!r}")
    if not 0.0 <= min_accuracy <= 1.0:
        raise ValueError(
            f"min_accuracy must lie in [0, 1] (a fraction of the full-context accuracy), "
            f"got {min_accuracy}"
        )
    if isinstance(prompt_len, bool) or not isinstance(prompt_len, int) or prompt_len < 1:
        raise ValueError(f"prompt_len must be a positive integer, got {prompt_len!r}")
    curve = calibration.curve(method)
    lengths = lengths_for(curve, prompt_len)
    if lengths is None:
        return None
    fractions = [feasible_fraction(curve.points_at(n), min_accuracy) for n in lengths]
    if any(f is None for f in fractions):
        return None
    fraction = max(f for f in fractions if f is not None)
    shortest = curve.lengths[0].length
    # Rounded first: 0.1 * 4100 is 410.00000000000006 in floating point, not 411 tokens.
    budget = math.ceil(round(fraction * max(prompt_len, shortest), 6))
    return None if budget >= prompt_len else budget
