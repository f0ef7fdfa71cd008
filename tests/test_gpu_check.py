"""``bench/gpu_check.py --dry-run``: the GPU check runs every section at tiny shapes on CPU
(what CI can run), so the script a GPU session relies on keeps working."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]


def test_dry_run_passes_every_section(tmp_path):
    out = tmp_path / "gpu_check.json"
    done = subprocess.run([sys.executable, "bench/gpu_check.py", "--dry-run", "--json",
                           str(out), "--work", str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report) == {"environment", "peak", "capture", "step", "resume", "evaluation",
                           "throughput"}
    assert not [name for name, section in report.items() if "error" in section]
    capture = report["capture"]
    assert 0 < max(capture["aux_relative_error"], capture["final_relative_error"]) <= 3e-2
    step = report["step"]
    assert len(step["seconds"]) == len(step["cudnn_allowed_seconds"]) == 3
    assert min(step["seconds"] + step["cudnn_allowed_seconds"]) > 0
    assert step["attention_shapes"] > 0
    resume = report["resume"]
    assert resume["killed_mid_run"] and resume["bit_identical"]
    assert resume["resumed_from_step"] == resume["killed_after_checkpoint"] < resume["steps"]
    evaluation = report["evaluation"]
    assert evaluation["lossless"] and evaluation["device_bf16"]["lossless"]
    assert evaluation["cpu_fp32"]["soundness"].startswith("all 2 contestants lossless")
    throughput = report["throughput"]
    assert throughput["capture"]["tokens_per_s"] > 0
    assert throughput["training"]["step_seconds"] > 0
    assert throughput["training"]["mfu_vs_measured"] > 0
    assert throughput["evaluation"]["candidate"]["tokens_per_s"] > 0
