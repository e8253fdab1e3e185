"""A scripted training process for the supervisor's unit tests (tests/pipeline/test_auto_resume.py).

It "trains" ``--steps`` steps, writing a checkpoint in DeepSpeed's layout every ``--save-steps`` steps the
way DeepSpeed does (every rank's files first, ``latest`` last; the files are zips like ``torch.save``'s),
resumes from ``latest`` with ``--ckpt.load_enable``, and fails as ``--plan`` says: ``ATTEMPT:STEP:HOW``
entries (HOW: ``kill`` = SIGKILL itself, ``raise`` = an uncaught RuntimeError, ``exit2``, ``exit3``, ``exit5``; ``*`` = every
attempt). It appends one line per trained step to ``<ckpt>/trained.txt``. The real pipeline's restarts
are tested in tests/pipeline/test_e2e_research.py (run B).
"""

import argparse
import os
import signal
import sys
import zipfile


def save(root, step, dp):
    tag = f"global_step{step}"
    os.makedirs(os.path.join(root, tag), exist_ok=True)
    names = ["mp_rank_00_model_states.pt"] + [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(dp)]
    for name in names:
        with zipfile.ZipFile(os.path.join(root, tag, name), "w") as z:
            z.writestr("archive/data.pkl", f"step {step}".encode())
    with open(os.path.join(root, "latest"), "w") as f:
        f.write(tag)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt.path", dest="ckpt")
    p.add_argument("--ckpt.load_enable", dest="load", action="store_true")
    p.add_argument("--steps", type=int)
    p.add_argument("--save-steps", type=int)
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--plan", default="")
    a = p.parse_args()
    attempt = int(os.environ["LPO_AUTO_RESUME_ATTEMPT"])
    root = os.path.join(a.ckpt, "_actor")
    start = 0
    if a.load and os.path.exists(os.path.join(root, "latest")):
        start = int(open(os.path.join(root, "latest")).read().strip().replace("global_step", ""))
    print(f"attempt {attempt} starts after step {start}", flush=True)
    plan = {}
    for entry in filter(None, a.plan.split(",")):
        att, step, how = entry.split(":")
        plan[(att, int(step))] = how
    for step in range(start + 1, a.steps + 1):
        how = plan.get((str(attempt), step)) or plan.get(("*", step))
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "raise":
            raise RuntimeError(f"bad batch at step {step}")
        if how == "exit3":
            print("lpo-train: 1 of 2 GPU node(s) cannot load fused_adam", file=sys.stderr, flush=True)
            sys.exit(3)
        if how == "exit5":
            print("lpo-train: the GPUs the run needs did not come back within --ckpt.auto_resume_wait 1800 s",
                  file=sys.stderr, flush=True)
            sys.exit(5)
        if how == "exit2":
            sys.exit(2)
        os.makedirs(root, exist_ok=True)
        with open(os.path.join(a.ckpt, "trained.txt"), "a") as f:
            f.write(f"{attempt} {step}\n")
        if step % a.save_steps == 0:
            save(root, step, a.dp)


if __name__ == "__main__":
    main()
