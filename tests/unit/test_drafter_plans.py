"""The training plans of benchmarks/draft_quality.py (eagle3_data.testing.drafters): the batches a run draws, and
the steps that give two drafters the same number of supervised tokens."""

from __future__ import annotations

import random

import pytest

from eagle3_data.testing.drafters import batch_plan, pack, steps_for_supervised


def test_pack_keeps_order_and_the_token_cap():
    lengths = {0: 300, 1: 200, 2: 100, 3: 600, 4: 50}
    assert pack([0, 1, 2, 3, 4], lengths, 512) == [[0, 1], [2], [3], [4]]  # a 600-token row alone
    assert pack([2, 1, 4, 0], lengths, 512) == [[2, 1, 4], [0]]


def test_the_plan_is_epochs_of_seeded_shuffles():
    lengths = {i: 100 + 37 * i for i in range(12)}
    plan = batch_plan(list(range(12)), lengths, 512, seed=3, steps=20)
    assert len(plan) == 20 and all(sum(lengths[i] for i in b) <= 512 or len(b) == 1 for b in plan)
    # the first epoch: one shuffle with random.Random(3), packed; every index once
    order = list(range(12))
    rng = random.Random(3)
    rng.shuffle(order)
    first = pack(order, lengths, 512)
    assert plan[: len(first)] == first and sorted(i for b in first for i in b) == list(range(12))
    # the next epoch is the same generator's next shuffle
    order = list(range(12))
    rng.shuffle(order)
    assert plan[len(first) : 2 * len(first)] == pack(order, lengths, 512)[: min(len(first), 20 - len(first))]
    assert batch_plan(list(range(12)), lengths, 512, seed=3, steps=20) == plan
    assert batch_plan(list(range(12)), lengths, 512, seed=4, steps=20) != plan


def test_steps_for_a_supervised_budget_are_the_fewest_that_reach_it():
    lengths = {i: 120 for i in range(20)}
    supervised = {i: 10 + (i % 4) * 30 for i in range(20)}  # 10, 40, 70, 100 supervised tokens
    idx = list(range(20))
    for budget in (1, 250, 999, 5000):
        n = steps_for_supervised(idx, lengths, supervised, 512, 7, budget)
        seen = [sum(supervised[i] for i in b) for b in batch_plan(idx, lengths, 512, 7, n)]
        assert sum(seen) >= budget and sum(seen) - seen[-1] < budget, (budget, n, seen)
    with pytest.raises(ValueError, match="no supervised token"):
        steps_for_supervised(idx, lengths, dict.fromkeys(idx, 0), 512, 7, 10)


def test_accepted_prefix_counts_drafts_equal_to_the_target_in_a_row_inside_the_mask_and_the_document():
    import torch

    from eagle3_data.testing.drafters import accepted_prefix

    target = torch.tensor([5, 6, 7, 8, 9, 1, 2, 3])
    mask = torch.tensor([0, 1, 1, 1, 1, 1, 1, 0])
    docs = torch.tensor([0, 0, 0, 0, 0, 1, 1, 1])
    # drafts[k][t]: the token drafted k steps after t; right everywhere, but for step 1 at t = 2
    drafts = [target.clone(), torch.cat([target[1:], torch.tensor([0])]), torch.cat([target[2:], torch.tensor([0, 0])])]
    drafts[1][2] = 99
    got = accepted_prefix(drafts, target, mask, docs).tolist()
    # t=0 unsupervised; t=1 all three; t=2 stops at step 1; t=3: its step 2 lands in document 1; t=4: step 1 does;
    # t=5, 6: document 1's mask ends at 6
    assert got == [0, 3, 1, 2, 1, 2, 1, 0]


def test_the_walk_drafts_where_the_last_verify_step_stopped():
    import torch

    from eagle3_data.testing.drafters import walk

    mask = torch.tensor([0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1])
    docs = torch.tensor([0] * 10 + [1] * 4)
    accepted = torch.tensor([0, 0, 3, 2, 0, 3, 1, 0, 0, 1, 0, 2, 0, 0])
    # document 0: first draft at 3 (after the target's own first token at 2): accepts 2 -> 6: 1 -> 8: 0 -> 9: 1
    # -> 11 > 9; document 1: first supervised 11, first draft at 12: 0 -> 13: 0 -> done
    assert walk(accepted, mask, docs) == (6, 4)
