"""``adaflash_hf.data.in_turn``: a benchmark's prompts take their domains in turn."""

from adaflash_hf.data import in_turn


def test_rows_take_the_domains_in_turn_and_a_short_domain_skips_its_turns():
    per_domain = {"chat": ["c0", "c1"], "code": ["k0"], "math": ["m0", "m1", "m2"]}
    assert in_turn(per_domain, 6) == ["c0", "k0", "m0", "c1", "m1"]
    assert in_turn(per_domain, 2) == ["c0", "k0"]


def test_a_short_domain_starts_over_when_cycling():
    assert in_turn({"chat": ["c0", "c1"], "code": ["k0"]}, 6, cycle=True) == [
        "c0",
        "k0",
        "c1",
        "k0",
        "c0",
        "k0",
    ]
