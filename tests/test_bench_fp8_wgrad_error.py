"""`benchmarks.fp8_wgrad_error`: its 128 x 1 tiles stay inside each group, and the errors it
reports order as the recipe's quantization implies."""

import numpy as np

from benchmarks.fp8_wgrad_error import QUICK, fp8_columns, group_sizes, measure


def test_column_tiles_start_at_each_group_and_never_span_two():
    """Ones quantize exactly (amax 1); a tile shared with the next group's rows of 1000 would not."""
    sizes = np.array([0, 130, 5])
    a = np.ones((135, 4), np.float32)
    a[130:] = 1000.0
    out = fp8_columns(a, sizes)
    np.testing.assert_array_equal(out[:130], 1.0)
    np.testing.assert_array_equal(out[130:], 1000.0)


def test_sizes_are_ragged_with_an_empty_group():
    sizes = group_sizes(1000, 8, np.random.default_rng(0))
    assert sizes.sum() == 1000 and sizes[0] == 0 and len(sizes) == 8


def test_fp8_weight_gradient_errs_more_than_todays_and_both_stay_small():
    (name, shape), = QUICK.items()
    rec = measure(name, shape, "normal")
    assert 0 < rec["today"]["rel_err"] < rec["dy-only"]["rel_err"] < rec["fp8"]["rel_err"] < 0.1
