"""The startup line: phases from process start to the first step, in order, adding up to the whole."""

import re
import time

from titan_kimi.training.reports.startup import StartupClock


def test_phases_are_named_in_order_and_add_up():
    clock = StartupClock(started_at=time.time() - 2.0)
    assert clock.line() is None
    clock.mark("imports")
    time.sleep(0.05)
    clock.mark("model")
    line = clock.line()
    assert re.match(r"startup: imports 2\.0 s, model 0\.[01] s; ", line), line
    names = [name for name, _ in clock.phases]
    assert names == ["imports", "model"]
    total = float(re.search(r"; ([\d.]+) s from process start to the first step$", line)[1])
    assert abs(total - sum(s for _, s in clock.phases)) < 0.06 and total >= 2.0


def test_this_process_start_anchors_the_first_phase():
    clock = StartupClock()
    clock.mark("imports")
    (name, seconds), = clock.phases
    assert name == "imports" and 0.0 <= seconds < 24 * 3600  # since this pytest process started
