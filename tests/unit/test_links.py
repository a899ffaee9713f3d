"""The link speed the compression policy decides at: ``compression.link_gbps`` and the hysteresis rule."""

import pytest

from luwu.protocol.compression import CompressionConfig
from luwu.protocol.errors import ConfigError
from luwu.protocol.policy import UNMEASURED_GBPS, LinkRule, link_speed


def feed(rule: LinkRule, series: list[float]) -> list[float | None]:
    """The decided speed after each measurement."""
    out = []
    for g in series:
        rule.observe(g)
        out.append(rule.decided)
    return out


def test_auto_is_the_default_and_a_told_number_wins():
    assert CompressionConfig().link_gbps == "auto"
    assert link_speed(CompressionConfig()) == UNMEASURED_GBPS
    assert link_speed(CompressionConfig(link_gbps=1)) == 1.0
    assert CompressionConfig(link_gbps="2.5").link_gbps == 2.5  # env / CLI text
    assert CompressionConfig(link_gbps=" AUTO ").link_gbps == "auto"
    for bad in ("fast", 0, -1.0, float("nan"), True):
        with pytest.raises(ConfigError, match="auto"):
            CompressionConfig(link_gbps=bad)


def test_the_first_measurement_decides_and_noise_inside_the_band_never_moves_it():
    rule = LinkRule(band=1.5, patience=3)
    assert rule.decided is None
    assert rule.observe(10.0) and rule.decided == 10.0
    noisy = [7.0, 14.0, 9.0, 12.5, 6.8, 14.9, 10.0] * 5
    assert feed(rule, noisy) == [10.0] * len(noisy)


def test_a_move_needs_patience_measurements_in_a_row_on_one_side():
    rule = LinkRule(band=1.5, patience=3)
    rule.observe(10.0)
    # two slow ones, then one inside the band: the streak is cleared
    assert feed(rule, [1.0, 1.1, 9.0, 0.9, 1.2, 10.0]) == [10.0] * 6
    # slow and fast alternating outside the band: never the same side three times
    assert feed(rule, [1.0, 40.0, 1.0, 40.0, 1.0, 40.0]) == [10.0] * 6
    # three slow in a row: the decision moves to their median, and stays there on the next noise
    assert feed(rule, [1.0, 0.9, 1.1]) == [10.0, 10.0, 1.0]
    assert feed(rule, [1.2, 0.8, 1.4]) == [1.0, 1.0, 1.0]
    # and back up the same way
    assert feed(rule, [20.0, 30.0, 25.0]) == [1.0, 1.0, 25.0]


def test_bad_measurements_are_ignored_and_bad_rules_refused():
    rule = LinkRule()
    assert not rule.observe(0.0) and not rule.observe(float("inf")) and rule.decided is None
    with pytest.raises(ValueError):
        LinkRule(band=1.0)
    with pytest.raises(ValueError):
        LinkRule(patience=0)
