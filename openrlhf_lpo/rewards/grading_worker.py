"""Grading worker processes: ``python -m openrlhf_lpo.rewards.grading_worker [--zygote FD]``.

With ``--zygote FD`` (how :class:`openrlhf_lpo.rewards.grader_pool.GraderPool` starts it) this is the fork
server that forks warmed-up workers; without arguments it is one worker speaking JSON lines on
stdin/stdout, useful to debug a start-up failure.
"""

import sys

from openrlhf_lpo.rewards.grader_pool import _worker_main, _zygote_main

if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--zygote":
        _zygote_main(int(sys.argv[2]))
    else:
        _worker_main()
