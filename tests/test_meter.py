"""The cost meter's arithmetic on constructed samples, energy that is never invented, and peak memory that
is the process's own."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from splitface.device.meter import BatchCost, EnergyCounter, latency_stats, peak_rss_bytes, summarize_costs


def test_latency_stats_drop_warmup_and_trim():
    samples = [100.0] + [float(i) for i in range(1, 11)]  # a slow first run, then 1..10
    s = latency_stats(samples, warmup=1, trim=0.1)
    assert s["n"] == 10 and s["mean"] == 5.5 and s["p50"] == 5.5
    assert s["trimmed_mean"] == 5.5  # drops 1 and 10
    assert s["p99"] == pytest.approx(9.91)
    skewed = latency_stats([1, 1, 1, 1, 1, 1, 1, 1, 1, 50], trim=0.1)
    assert skewed["mean"] == pytest.approx(5.9) and skewed["trimmed_mean"] == 1.0
    with pytest.raises(ValueError):
        latency_stats([1.0], warmup=1)


def test_energy_without_a_counter_is_none_with_a_reason(tmp_path):
    counter = EnergyCounter(tmp_path / "powercap")
    assert not counter.available and counter.read_joules() is None and "no RAPL" in counter.reason
    zone = tmp_path / "powercap" / "intel-rapl:0"
    zone.mkdir(parents=True)
    (zone / "energy_uj").write_text("2500000\n")
    counter = EnergyCounter(tmp_path / "powercap")
    assert counter.available and counter.reason is None and counter.read_joules() == 2.5


def test_summary_splits_round_trip_into_network_and_server():
    costs = [BatchCost(0.1 * k, 0.2, 0.01, 0.5, 0.3, 1000, 2000, 10 << 20, None) for k in (9, 1, 1, 1)]
    s = summarize_costs(costs, warmup=1, energy_reason="no counter")
    assert s["forward_s"]["mean"] == pytest.approx(0.1)  # the warm-up batch (0.9 s) is excluded
    assert s["network_s"]["mean"] == pytest.approx(0.2)
    assert s["energy_j_per_batch"] is None and s["energy_note"] == "no counter"
    unknown_server = [BatchCost(0.1, 0.2, 0.01, 0.5, None, 1, 1, 1, None)] * 3
    assert summarize_costs(unknown_server)["network_s"] is None


def test_peak_memory_is_the_processs_own_not_its_parents():
    """Linux carries ru_maxrss over fork and exec; a device process started by a large parent must not
    report the parent's peak."""
    held = np.ones(300 * 2**20 // 8)  # 300 MB touched in this process
    child = subprocess.run([sys.executable, "-c", "from splitface.device.meter import peak_rss_bytes; "
                            "print(peak_rss_bytes())"], capture_output=True, text=True, check=True)
    assert int(child.stdout) < 250 * 2**20 < peak_rss_bytes()
    del held
