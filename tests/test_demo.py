"""The main job (`kpool demo`) end to end on small sizes: it raises on any byte that differs
from the oracle, so passing means every pool, ring and selection row checked was exact."""

import subprocess
import sys

from kpool.cli import main
from kpool.demo import format_summary, run_demo


def test_demo_session_checks(backend):
    small = dict(requests=2, max_prompt=60, decode_steps=2) if backend == "triton" else \
        dict(requests=4, max_prompt=2400, decode_steps=8)
    stats = run_demo(quiet=True, index_topk=64 if backend == "triton" else 2048, **small)
    assert stats["checks"] == stats["prefill_steps"] + stats["decode_steps"]
    assert stats["pools_checked"] > 0 and stats["select_rows_checked"] > 0
    assert stats["backend"] == backend
    assert [len(stats[k]) for k in ("prefill_times", "decode_times", "select_times")] == \
        [stats["prefill_steps"], stats["decode_steps"], stats["decode_steps"]]
    summary = format_summary(stats)
    assert "checks passed" in summary and summary.count("ms per step") == 3


def test_cli_demo_prints_summary(capsys):
    assert main(["demo", "--requests", "2", "--max-prompt", "40", "--decode-steps", "2", "--device", "cpu"]) == 0
    assert "checks passed" in capsys.readouterr().out


def test_python_m_kpool_is_the_console_script():
    """``python -m kpool`` runs ``kpool.cli`` (where the console script is not on PATH)."""
    done = subprocess.run([sys.executable, "-m", "kpool", "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "demo" in done.stdout, done.stderr
