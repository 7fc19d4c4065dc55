"""The progress line: counts, percentage and the time-left estimate from the mean rate."""
import logging

from compatlas.progress import Progress, _clock


def test_clock_formats():
    assert _clock(5) == "5s" and _clock(65) == "1m05s" and _clock(3725) == "1h02m05s"


def test_progress_estimates_time_left_from_the_mean_rate(caplog):
    p = Progress(logging.getLogger("t"), "ablation", total=4, unit="heads", every=1e9)
    p.t0 -= 10.0  # 10 s elapsed for the first piece
    p.done = 1
    assert p.line(now=p.t0 + 10.0) == "ablation: 1/4 heads (25%), 10s elapsed, about 30s left"
    with caplog.at_level(logging.INFO):
        p.advance(2)  # not the last piece, interval not reached: silent
        assert not caplog.records
        p.advance(1)  # the last piece always logs, without an estimate
    assert caplog.records[-1].getMessage().startswith("ablation: 4/4 heads (100%)")
    assert "left" not in caplog.records[-1].getMessage()
