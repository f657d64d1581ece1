"""τ has one definition, ``adaflash_hf.stats.tau_of``: committed tokens per drafting round."""

from adaflash_hf.stats import AdaFlashStats, tau_of


def test_tau_is_committed_tokens_per_round():
    assert tau_of(7, 2) == 3.5


def test_tau_is_zero_without_rounds():
    assert tau_of(0, 0) == 0.0


def test_stats_tau_counts_each_round_accepted_plus_bonus():
    stats = AdaFlashStats(block_size=4)
    stats.add_round(draft_length=3, accepted=3, predicted=1.0)
    stats.add_round(draft_length=2, accepted=0, predicted=0.5)
    assert stats.tau == tau_of(3 + 1 + 0 + 1, 2) == 2.5
