"""The acceptance of drafted tokens alone (swaserve/speculative/verify.py): greedy cases by
hand, and the emitted distribution equal to the target's for one-hot and non-trivial draft
distributions (total variation under 0.01 with 200k draws: the sampling noise of a 6-token
distribution at that size is about 0.003)."""

from __future__ import annotations

import pytest
import torch

from swaserve.speculative.verify import verify_drafts


def _onehot_logits(rows: list[int], V: int = 8) -> torch.Tensor:
    x = torch.full((len(rows), V), -5.0)
    x[torch.arange(len(rows)), torch.tensor(rows)] = 5.0
    return x


def test_greedy_longest_matching_prefix_then_the_targets_token():
    # target argmax per row: 3, 4, 5, 6; drafts 3, 4, 7: two accepted, then row 2's 5
    logits = _onehot_logits([3, 4, 5, 6]).unsqueeze(0)
    out = verify_drafts(logits, torch.tensor([[3, 4, 7]]), [3], [True])
    assert out.num_accepted.tolist() == [2]
    assert out.token_ids.tolist() == [[3, 4, 5, -1]]
    # all accepted: the bonus from the last row; none accepted: row 0's token
    out = verify_drafts(logits.repeat(3, 1, 1), torch.tensor([[3, 4, 5], [1, 4, 5], [3, 4, 5]]),
                        [3, 3, 1], [True] * 3)
    assert out.num_accepted.tolist() == [3, 0, 1]
    assert out.token_ids.tolist() == [[3, 4, 5, 6], [3, -1, -1, -1], [3, 4, -1, -1]]


def _emitted_distributions(out, num_drafts: int, V: int) -> list[torch.Tensor]:
    """Per position j: the distribution of emitted token j over the draws that reached j."""
    dists = []
    for j in range(num_drafts + 1):
        reached = out.num_accepted >= j
        toks = out.token_ids[reached, j]
        dists.append(torch.bincount(toks, minlength=V).double() / max(1, toks.numel()))
    return dists


@pytest.mark.parametrize("drafter", ["one-hot", "distribution"])
def test_sampling_emits_the_targets_distribution(drafter):
    torch.manual_seed(0)
    V, K, N = 6, 3, 200_000
    target = torch.randn(K + 1, V) * 1.5
    p = target.softmax(-1)
    if drafter == "one-hot":
        q_rows = torch.randn(K, V).softmax(-1)  # the drafter's choice, one-hot per draw
        drafts = torch.multinomial(q_rows, N, replacement=True).T  # [N, K]
        draft_probs = None
    else:
        q_rows = (torch.randn(K, V) * 2).softmax(-1)
        drafts = torch.multinomial(q_rows, N, replacement=True).T
        draft_probs = q_rows.unsqueeze(0).expand(N, K, V)
    g = torch.Generator().manual_seed(1)
    out = verify_drafts(target.unsqueeze(0).expand(N, K + 1, V), drafts,
                        [K] * N, [False] * N,
                        draft_probs=draft_probs, default_generator=g)
    for j, emitted in enumerate(_emitted_distributions(out, K, V)):
        tv = 0.5 * (emitted - p[j].double()).abs().sum().item()
        assert tv < 0.01, (drafter, j, tv)
    # real acceptance: some draws accepted everything, some nothing
    counts = torch.bincount(out.num_accepted, minlength=K + 1)
    assert counts.min() > 0, counts


def test_seeded_requests_do_not_depend_on_the_batch():
    torch.manual_seed(3)
    V, K = 7, 4
    logits = torch.randn(5, K + 1, V)
    drafts = torch.randint(0, V, (5, K))
    lens = [4, 2, 0, 3, 4]
    greedy = [False, False, False, True, False]

    def run(rows: list[int]):
        gens = [torch.Generator().manual_seed(100 + r) for r in rows]
        return verify_drafts(logits[rows], drafts[rows], [lens[r] for r in rows],
                             [greedy[r] for r in rows],
                             generators=gens, default_generator=torch.Generator().manual_seed(9))

    together = run([0, 1, 2, 3, 4])
    for r in range(5):
        alone = run([r])
        assert together.token_ids[r].tolist() == alone.token_ids[0].tolist()
        assert together.num_accepted[r] == alone.num_accepted[0]
