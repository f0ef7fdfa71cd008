"""The sglang-restart hook: placeholders, success, failure with stderr, timeout that kills."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import replace

import pytest

from pipeline.eagle3.spec import SpecParams
from pipeline.release.backend import LedgerBackend, ServingError
from pipeline.release.ledger import ServingLedger
from pipeline.release.restart import RestartHook, placeholders, run_hook
from pipeline.serving_now import ServingTarget
from pipeline.storage import Storage
from tests.release.helpers import make_drafter_dir, publish_drafter

pytestmark = pytest.mark.integration

SETTINGS = SpecParams(4, 1, 5)
PY = sys.executable


@pytest.fixture
def published(tmp_path):
    storage = Storage((tmp_path / "storage").as_uri())
    uri = publish_drafter(storage, 3, make_drafter_dir(tmp_path / "d"), fingerprint="fp3")
    return storage, ServingTarget(drafter_uri=uri, fingerprint="fp3",
                                  registry_model="aerie-drafter-demo", registry_version="3")


def test_success_fills_placeholders_without_a_shell(published, tmp_path):
    storage, target = published
    out = tmp_path / "args.txt"
    hook = RestartHook([PY, "-c", "import sys; open(sys.argv[1], 'w').write('|'.join("
                        "sys.argv[2:]))", str(out), "{drafter_dir}", "--steps={num_steps}",
                        "{topk}", "{num_draft_tokens}", "v{registry_version}", "{fingerprint}",
                        "$HOME;{{literal}}"], SETTINGS, timeout_s=30)
    backend = LedgerBackend(ServingLedger(storage, "demo"), SETTINGS, hook,
                            cache_dir=tmp_path / "cache")
    manifest = backend.apply(target, reason="promote v3")
    drafter_dir = backend._local(target)  # the verified copy in the cache
    assert drafter_dir.parent == tmp_path / "cache"
    assert out.read_text().split("|") == [str(drafter_dir), "--steps=4", "1", "5", "v3",
                                          "fp3", "$HOME;{literal}"]
    assert manifest.mode == "sglang-restart" and manifest.details["exit_status"] == "0"
    assert backend.current() == manifest


def test_failure_carries_stderr_and_records_nothing(published, tmp_path):
    storage, target = published
    hook = RestartHook([PY, "-c", "import sys; print('launching'); "
                        "sys.stderr.write('CUDA out of memory\\n'); sys.exit(3)"],
                       SETTINGS, timeout_s=30)
    backend = LedgerBackend(ServingLedger(storage, "demo"), SETTINGS, hook,
                            cache_dir=tmp_path / "cache")
    with pytest.raises(ServingError, match="exit status 3.*CUDA out of memory"):
        backend.apply(target, reason="promote v3")
    assert backend.current() is None


def test_timeout_kills_the_whole_process_group(tmp_path):
    pid_file = tmp_path / "child.pid"
    code = ("import subprocess, sys, time; "
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    t0 = time.monotonic()
    with pytest.raises(ServingError, match="timed out after 1s"):
        run_hook([PY, "-c", code], timeout_s=1)
    assert time.monotonic() - t0 < 15
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child), "the hook's own child must die with it"


def test_a_missing_executable_is_a_serving_error():
    with pytest.raises(ServingError, match="cannot start"):
        run_hook(["/nonexistent/restart-sglang"], timeout_s=5)


def test_unknown_placeholders_are_rejected_when_built():
    assert placeholders(["x{drafter_dir}", "{{not}}", "{topk}"]) == {"drafter_dir", "topk"}
    with pytest.raises(ValueError, match="unknown placeholders \\['model_path'\\]"):
        RestartHook(["restart", "{model_path}"], SETTINGS)
    with pytest.raises(ValueError, match="plain name"):
        RestartHook(["restart", "{drafter_dir!r}"], SETTINGS)
    with pytest.raises(ValueError, match="cannot name a drafter"):
        RestartHook(["restart"], SETTINGS, no_drafter_argv=["r", "{drafter_dir}"])


def test_no_drafter_needs_its_own_command(tmp_path):
    hook = RestartHook([PY, "-c", "pass"], SETTINGS)
    with pytest.raises(ServingError, match="no_drafter_argv"):
        hook.activate(None, None)
    out = tmp_path / "nd.txt"
    hook = RestartHook([PY, "-c", "pass"], SETTINGS, no_drafter_argv=[
        PY, "-c", "import sys; open(sys.argv[1], 'w').write('plain')", str(out)])
    assert hook.activate(None, None)["exit_status"] == "0" and out.read_text() == "plain"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_command_with_server_runs_once_per_server_and_a_canary_restarts_its_own(
        published, tmp_path):
    storage, target = published
    out = tmp_path / "restarted"
    out.mkdir()
    hook = RestartHook([PY, "-c", "import sys, pathlib; pathlib.Path(sys.argv[1], "
                        "sys.argv[2]).write_text(sys.argv[3])", str(out), "{server}",
                        "v{registry_version}"], SETTINGS, timeout_s=30,
                       servers=("s0", "s1", "s2", "s3"))
    backend = LedgerBackend(ServingLedger(storage, "demo"), SETTINGS, hook,
                            cache_dir=tmp_path / "cache")
    backend.apply(target, reason="promote v3")
    assert {p.name: p.read_text() for p in out.iterdir()} == {f"s{i}": "v3" for i in range(4)}
    other = replace(target, fingerprint="fp4", registry_version="4")
    publish_drafter(storage, 4, make_drafter_dir(tmp_path / "d4", seed=4), fingerprint="fp4")
    other = replace(other, drafter_uri=storage.url("drafters/step=000004"))
    manifest = backend.start_canary(other, started_at=5, share=0.5, reason="canary v4")
    assert manifest.canary.servers == ("s0", "s1")
    assert {p.name: p.read_text() for p in out.iterdir()} == {
        "s0": "v4", "s1": "v4", "s2": "v3", "s3": "v3"}
    with pytest.raises(ValueError, match="needs the servers"):
        RestartHook([PY, "{server}"], SETTINGS)
