"""The alerting and recording rules of deploy/prometheus/rules.yaml, unit-tested with values the way the
Prometheus ecosystem does it: `promtool test rules` on the series deploy/prometheus/rules_test.yaml writes.
Every alert must be shown there both firing (labels and annotations as expected) and not firing."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

PROMETHEUS = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"
RULES = PROMETHEUS / "rules.yaml"
RULES_TEST = PROMETHEUS / "rules_test.yaml"


def promtool() -> str:
    binary = shutil.which("promtool")
    if binary is None:
        pytest.skip("promtool is not installed (Debian package prometheus; `make setup` installs it where it can)")
    return binary


def alerts() -> list[str]:
    return [r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r]


def test_rules_test_file_covers_every_alert_firing_and_not():
    spec = yaml.safe_load(RULES_TEST.read_text())
    assert spec["rule_files"] == [RULES.name]
    # Recording groups before the alerts that read them, or promtool picks an order at random.
    assert spec["group_eval_order"] == [g["name"] for g in yaml.safe_load(RULES.read_text())["groups"]]
    cases = [c for t in spec["tests"] for c in t.get("alert_rule_test", [])]
    for name in alerts():
        mine = [c for c in cases if c["alertname"] == name]
        assert any(c["exp_alerts"] for c in mine), f"{name}: no case where it fires"
        assert any(not c["exp_alerts"] for c in mine), f"{name}: no case where it stays quiet"
        for case in mine:
            for alert in case["exp_alerts"]:
                assert alert["exp_labels"].get("severity") and alert["exp_annotations"].get("summary"), (
                    f"{name} at {case['eval_time']}: expect its severity and its summary")
    assert {c["alertname"] for c in cases} <= set(alerts()), "a case names an alert rules.yaml does not have"


def test_promtool_unit_tests_of_the_rules_pass():
    proc = subprocess.run([promtool(), "test", "rules", RULES_TEST.name], cwd=PROMETHEUS, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, f"promtool test rules failed:\n{proc.stdout}{proc.stderr}"
    assert "SUCCESS" in proc.stdout
