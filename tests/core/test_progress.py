"""Progress bars written to a file or a pipe: plain lines every few percent, no carriage-return frames."""

import subprocess
import sys

SCRIPT = r"""
import sys, time
from openrlhf_lpo.runtime.progress import install
assert install()
from tqdm import tqdm
for _ in tqdm(range(200), desc="train"):
    time.sleep(0.004)
for _ in tqdm(range(3), desc="short"):
    pass
"""


def test_progress_lines_when_not_a_tty():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.startswith(("train", "short"))]
    assert "\r" not in out.stderr
    train = [line for line in lines if line.startswith("train")]
    assert 2 <= len(train) <= 21 and "100%" in train[-1] and "200/200" in train[-1]  # at most one per 5%
    assert sum(line.startswith("short") for line in lines) == 1 and "3/3" in lines[-1]


def test_terminals_keep_the_normal_bars():
    code = ("from openrlhf_lpo.runtime.progress import install\n"
            "class Tty:\n    def isatty(self):\n        return True\n"
            "print(install(Tty()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr


DEMO_BARS = r"""
from openrlhf_lpo.demo.warmup import _bar
for name in ("warm-up (SFT)", "lpo-fwd", "held-out evaluation"):  # every bar of lpo-demo goes through _bar
    bar = _bar(300, name, True)
    for i in range(300):
        bar.update(1)
        bar.set_postfix(acc=i)
    bar.close()
"""


def test_lpo_demo_and_benchmark_bars_are_lines_in_a_log_file(tmp_path):
    """lpo-demo (and the benchmarks that reuse its warm-up and step bars) wrote one carriage-return
    frame per update into a log file (642 in one demo log); now a line every 5% at most."""
    log = tmp_path / "demo.log"
    with open(log, "w") as f:
        out = subprocess.run([sys.executable, "-c", DEMO_BARS], stdout=f, stderr=subprocess.STDOUT, timeout=120)
    assert out.returncode == 0, log.read_text()[-2000:]
    text = log.read_text()
    assert "\r" not in text
    for name in ("warm-up (SFT)", "lpo-fwd", "held-out evaluation"):
        lines = [line for line in text.splitlines() if line.startswith(name)]
        assert 2 <= len(lines) <= 21 and "300/300" in lines[-1], lines
