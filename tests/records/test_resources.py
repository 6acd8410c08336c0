"""The resource envelope: each phase's seconds and its own peak memory (the peak is reset
between phases, so a small phase after a large one reports its own size)."""

import torch

from dapo_mega.records.resources import GIB, PhaseMeter


def test_each_phase_reports_its_own_rss_peak():
    meter = PhaseMeter(cuda=False)
    with meter.phase("large"):
        big = torch.ones(512 << 20, dtype=torch.uint8)  # 512 MiB, touched
        del big
    with meter.phase("small"):
        small = torch.ones(64 << 20, dtype=torch.uint8)
        del small
    m = meter.metrics
    assert set(m) == {"time/large_s", "time/small_s", "mem/large/rss_peak_gib", "mem/small/rss_peak_gib"}
    assert m["mem/large/rss_peak_gib"] * GIB >= 512 << 20
    assert m["mem/large/rss_peak_gib"] - m["mem/small/rss_peak_gib"] > 0.3  # reset: not the lifetime peak
    assert m["mem/small/rss_peak_gib"] * GIB >= 64 << 20
    assert meter.timings() == {"time/large_s": m["time/large_s"], "time/small_s": m["time/small_s"]}


def test_a_phase_that_raises_is_still_recorded():
    meter = PhaseMeter(cuda=False)
    try:
        with meter.phase("save"):
            raise OSError("disk full")
    except OSError:
        pass
    assert "time/save_s" in meter.metrics
