"""The device-side free stack (kv/free_stack.py) against a host list: masked takes and
gives hand out and take back exactly the ids a plain LIFO list would."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparsevllm.kv.free_stack import DeviceFreeStack

ROWS = 12
masks = st.lists(st.booleans(), min_size=0, max_size=6)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.booleans(), masks), max_size=25))
def test_masked_takes_and_gives_match_a_host_list(ops):
    stack = DeviceFreeStack(ROWS, torch.device("cpu"))
    free = list(range(ROWS - 1, -1, -1))  # the reference: popped from the end
    held: list[int] = []
    for is_take, mask in ops:
        want = torch.tensor(mask, dtype=torch.bool)
        if is_take:
            n = sum(mask)
            if n > len(free):
                continue  # running dry is checked below
            ids = stack.take(want).tolist()
            expected = iter(free[len(free) - n :][::-1])
            del free[len(free) - n :]
            assert ids == [next(expected) if m else stack.trash for m in mask]
            held += [i for i, m in zip(ids, mask) if m]
        else:
            back = held[: len(mask)]
            keep = want[: len(back)]
            stack.give(torch.tensor(back, dtype=torch.long), keep)
            given_back = [i for i, k in zip(back, keep.tolist()) if k]
            free += given_back
            held = [i for i in held if i not in given_back]
        assert stack.num_free == len(free)
        assert stack.ids[: len(free)].tolist() == free
    assert stack.ran_dry() == 0


def test_running_dry_is_reported_and_never_reads_out_of_bounds():
    stack = DeviceFreeStack(3, torch.device("cpu"))
    assert stack.take(torch.ones(3, dtype=torch.bool)).tolist() == [0, 1, 2]
    assert stack.ran_dry() == 0  # exactly empty is not dry
    ids = stack.take(torch.ones(2, dtype=torch.bool))
    assert ids.min() >= 0 and ids.max() < 3  # wrong ids, but in bounds
    assert stack.ran_dry() == 2
