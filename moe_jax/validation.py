"""Argument checks shared by every module of moe_jax (a leaf: it imports no other moe_jax module).

Each check names the argument and says what would be accepted, raising `TypeError` for a value of
the wrong kind and `ValueError` for a value of the right kind out of range. Integers and numbers
may be Python or NumPy scalars (`np.int64(4)`, `np.float32(1.25)`); booleans are never numbers
here, since `True` for a size is almost always a mistake.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

__all__ = ["check_bool", "check_int", "check_number", "is_int"]


def is_int(value) -> bool:
    """True for Python and NumPy integers, False for bools and everything else."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def check_int(name: str, value, *, minimum: int | None = 1) -> int:
    """`value` as a Python int, checked to be an integer `>= minimum` (no lower bound when None).

    TypeError for non-integers (floats, bools, strings), ValueError below `minimum`.
    """
    want = "an int" if minimum is None else "a positive int" if minimum == 1 else f"an int >= {minimum}"
    if not is_int(value):
        raise TypeError(f"{name} must be {want}; got {type(value).__name__} {value!r}.")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be {want}; got {value}.")
    return value


def check_number(name: str, value, *, positive: bool = True, hint: str = "") -> float:
    """`value` as a Python float, checked to be a finite real number (and `> 0` when `positive`).

    TypeError for non-numbers (bools and strings included), ValueError for NaN, infinities and,
    when `positive`, values `<= 0`. `hint` is appended to the ValueError's message.
    """
    if not isinstance(value, numbers.Real) or isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a number; got {type(value).__name__} {value!r}.")
    value = float(value)
    if not math.isfinite(value) or (positive and value <= 0):
        want = "a finite number > 0" if positive else "a finite number"
        raise ValueError(f"{name} must be {want}{hint}; got {value!r}.")
    return value


def check_bool(name: str, value) -> bool:
    """`value` as a Python bool; TypeError unless it is a Python or NumPy bool."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool; got {type(value).__name__} {value!r}.")
    return bool(value)
