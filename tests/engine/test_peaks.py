"""The device's peaks (the MFU and MBU denominators): configured, from the table, or measured once per machine."""
from __future__ import annotations

import json

import pytest
import torch

from pdserve.engine import utilization
from pdserve.engine.utilization import device_peaks


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_peaks_configured_or_measured(cache):
    assert device_peaks(torch.device("cpu"), 1e12, 1e11).source == "configured"
    p = device_peaks(torch.device("cpu"))
    assert p.source == "measured" and p.flops_per_second > 1e8 and p.bytes_per_second > 1e8


def test_measured_once_per_thread_count_and_kept(cache, monkeypatch):
    calls = []

    def measure(device):
        calls.append(torch.get_num_threads())
        return 1e9 * len(calls), 2e9 * len(calls)

    monkeypatch.setattr(utilization, "measure_peaks", measure)
    cpu = torch.device("cpu")
    first = device_peaks(cpu)
    assert (first.flops_per_second, first.bytes_per_second) == (1e9, 2e9) and len(calls) == 1
    again = device_peaks(cpu)  # a worker started later on this machine: the first figure, not measured
    assert (again.flops_per_second, again.bytes_per_second, again.source) == (1e9, 2e9, "measured")
    assert len(calls) == 1
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)  # another thread count peaks elsewhere: its own measurement
        assert device_peaks(cpu).flops_per_second == 2e9 and len(calls) == 2
    finally:
        torch.set_num_threads(threads)
    (kept,) = [f for f in (cache / "peaks").iterdir() if json.loads(f.read_text())["threads"] == threads]
    kept.write_text("{not json")  # a damaged file is measured again and rewritten
    assert device_peaks(cpu).flops_per_second == 3e9 and len(calls) == 3
    assert json.loads(kept.read_text())["flops_per_second"] == 3e9
    assert not list((cache / "peaks").glob("*.tmp"))
