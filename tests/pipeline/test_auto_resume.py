"""``--ckpt.auto_resume N``: the supervisor restarts a dead run from its last whole checkpoint, logs each restart
with its cause, stops a failure that repeats at one checkpoint after N restarts, never restarts a flag error,
and never loads a checkpoint a kill cut off. The supervisor here is the real one around a scripted child
(tests/pipeline/auto_resume_child.py); the real pipeline's kills (a Ray worker, the driver) are in
tests/pipeline/test_e2e_research.py (run B)."""

import io
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from openrlhf_lpo.cli import auto_resume
from openrlhf_lpo.cli.preflight.checkpoint import resume_point
from openrlhf_lpo.cli.train_ppo_ray import build_parser_and_parse

CHILD = str(Path(__file__).with_name("auto_resume_child.py"))


def _argv(ckpt, *extra):
    return ["--actor.model_name_or_path", "unused", "--reward.remote_url", "http://unused",
            "--actor.num_gpus_per_node", "2", "--rollout.n_samples_per_prompt", "4", "--rollout.batch_size", "2",
            "--train.batch_size", "8", "--train.micro_batch_size", "4", "--algo.advantage.estimator", "lpo",
            "--ckpt.path", str(ckpt), "--ckpt.save_steps", "2", *extra]


def _supervise(tmp_path, plan, n=2, steps=6, extra=()):
    ckpt = tmp_path / "ckpt"
    args = build_parser_and_parse(_argv(ckpt, "--ckpt.auto_resume", str(n), "--ckpt.auto_resume_delay", "0"))
    out, err = io.StringIO(), io.StringIO()
    cmd = [sys.executable, CHILD, "--ckpt.path", str(ckpt), "--steps", str(steps), "--save-steps", "2",
           "--plan", plan, *extra]
    sup = auto_resume.Supervisor(cmd, args, env=dict(os.environ), out=out, err=err)
    rc = sup.run()
    trained = [tuple(map(int, line.split())) for line in (ckpt / "trained.txt").read_text().splitlines()] \
        if (ckpt / "trained.txt").exists() else []
    return rc, sup, out.getvalue(), err.getvalue(), trained


def test_a_killed_run_restarts_from_its_last_checkpoint(tmp_path):
    rc, sup, out, err, trained = _supervise(tmp_path, "1:3:kill,2:5:raise")
    assert rc == 0, err
    # attempt 1 trained 1-2 (checkpoint) and died in 3; attempt 2 resumed at 3, checkpointed 4, died in 5;
    # attempt 3 resumed at 5: every step after the last checkpoint is trained again, nothing else
    assert trained == [(1, 1), (1, 2), (2, 3), (2, 4), (3, 5), (3, 6)]
    assert [(a.number, a.cause, a.resumed_from, a.reached) for a in sup.attempts] == [
        (1, "killed by SIGKILL", None, "global_step2"),
        (2, "exit 1: RuntimeError: bad batch at step 5", "global_step2", "global_step4")]
    assert "attempt 1 died (killed by SIGKILL); restart 1/2 from global_step2" in err
    assert "attempt 2 died (exit 1: RuntimeError: bad batch at step 5); restart 1/2 from global_step4" in err
    assert "the run finished after 2 restarts" in err
    assert "attempt 3 starts after step 4" in out  # the child's own output passes through


def test_a_failure_that_repeats_at_one_checkpoint_stops_naming_its_cause(tmp_path):
    rc, sup, _, err, trained = _supervise(tmp_path, "*:3:raise", n=2)
    assert rc == 1
    assert len(sup.attempts) == 3  # N = 2 restarts, then it stops
    assert trained == [(1, 1), (1, 2)]
    assert ("giving up: 3 attempts in a row failed from global_step2 (--ckpt.auto_resume 2 allows 2 restarts "
            "from one checkpoint); last cause: exit 1: RuntimeError: bad batch at step 3") in err


def test_progress_resets_the_count(tmp_path):
    """N = 1 survives three preemptions, because each restart reaches a newer checkpoint."""
    rc, sup, _, err, trained = _supervise(tmp_path, "1:3:kill,2:5:kill,3:7:kill", n=1, steps=8)
    assert rc == 0, err
    assert [s for _, s in trained] == list(range(1, 9)) and len(sup.attempts) == 3


def test_a_run_that_dies_before_its_first_checkpoint_starts_over(tmp_path):
    rc, sup, _, err, trained = _supervise(tmp_path, "1:1:kill", n=1, steps=2)
    assert rc == 0 and trained == [(2, 1), (2, 2)]
    assert "restart 1/1 from step 0 (no complete checkpoint yet)" in err


@pytest.mark.parametrize("how, said", [
    ("exit2", "a flag or input error"),
    ("exit3", "a GPU node cannot build DeepSpeed's optimizer op (an install error)"),
    ("exit5", "the Ray cluster lacks the GPUs the layout needs (--ckpt.auto_resume_wait passed on a restart)")])
def test_final_causes_are_never_restarted(tmp_path, how, said):
    """Exit 2 (flags, a --ckpt.path the nodes do not share), 3 (a node cannot build the optimizer op: retrying
    cannot install it) and 5 (the cluster stayed too small through the restart's wait) end the run at once."""
    from openrlhf_lpo.cli import capacity, gpu_build

    rc, sup, _, err, trained = _supervise(tmp_path, f"1:3:{how}", n=2)
    code = int(how[-1])
    assert rc == code and len(sup.attempts) == 1 and trained == [(1, 1), (1, 2)], err
    assert f"attempt 1 stopped with exit {code}, {said}: not a preemption, not restarted" in err
    # the numbers the supervisor knows are the ones the checks exit with
    assert capacity.EXIT_CLUSTER_TOO_SMALL == 5 and "raise SystemExit(3)" in open(gpu_build.__file__).read()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_stopped_supervisor_takes_its_run_with_it(tmp_path, repo_env, sig):
    """SIGTERM is forwarded to the run and nothing restarts; SIGKILL (a cancelled job) leaves no orphaned
    training behind: the kernel kills the child with its parent (PR_SET_PDEATHSIG)."""
    ckpt = tmp_path / "ckpt"
    # the parsed flags reach the supervisor's process pickled: it need not import the stock CLI (~15 s)
    args_file = tmp_path / "args.pkl"
    args_file.write_bytes(pickle.dumps(build_parser_and_parse(
        _argv(ckpt, "--ckpt.auto_resume", "3", "--ckpt.auto_resume_delay", "0"))))
    code = f"""
import pickle, sys
from openrlhf_lpo.cli import auto_resume
args = pickle.loads(open({str(args_file)!r}, "rb").read())
cmd = [sys.executable, "-c", "import time; print('child up', flush=True); time.sleep(120)"]
sys.exit(auto_resume.Supervisor(cmd, args).run())
"""
    proc = subprocess.Popen([sys.executable, "-c", code], env=repo_env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    lines, errs = [], []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    threading.Thread(target=lambda: errs.extend(proc.stderr), daemon=True).start()
    t0 = time.time()
    while not any("child up" in x for x in lines) and time.time() - t0 < 60:
        time.sleep(0.1)
    child = int(next(x for x in errs if "attempt 1: pid" in x).split("pid")[1])
    proc.send_signal(sig)
    proc.wait(timeout=60)
    t0 = time.time()
    while _alive(child) and time.time() - t0 < 10:
        time.sleep(0.1)
    assert not _alive(child), "the training child outlived its supervisor"
    time.sleep(0.5)
    err = "".join(errs)
    if sig == signal.SIGTERM:
        assert proc.returncode == 128 + signal.SIGTERM
        assert "stopped by SIGTERM: not restarted (killed by SIGTERM)" in err
    assert err.count("attempt 1: pid") == 1 and "attempt 2" not in err


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie is dead, waiting to be reaped
    except FileNotFoundError:
        return False


# ----------------------------------------------------------------------------- which checkpoint is loaded


def _deepspeed_ckpt(root: Path, step: int, dp: int = 2):
    tag = root / f"global_step{step}"
    tag.mkdir(parents=True)
    torch.save({"module": {"w": torch.ones(3)}, "param_shapes": []}, tag / "mp_rank_00_model_states.pt")
    for r in range(dp):
        torch.save({"optimizer_state_dict": {"r": r}}, tag / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
    (root / "latest").write_text(tag.name)
    return tag


@pytest.mark.parametrize("damage", ["cut", "missing_rank", "empty_latest", "deleted"])
def test_a_checkpoint_cut_off_by_a_kill_is_never_loaded(tmp_path, damage):
    root = tmp_path / "ckpt" / "_actor"
    _deepspeed_ckpt(root, 2)
    newest = _deepspeed_ckpt(root, 4)
    optim = newest / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    why = {"cut": "zero_pp_rank_1_mp_rank_00_optim_states.pt is cut off (no zip directory)",
           "missing_rank": "optimizer states of ranks [0], this run has 2 data-parallel ranks",
           "empty_latest": "latest is missing or empty", "deleted": "no such folder"}[damage]
    if damage == "cut":
        data = optim.read_bytes()
        optim.write_bytes(data[: len(data) // 2])
    elif damage == "missing_rank":
        optim.unlink()
    elif damage == "empty_latest":
        (root / "latest").write_text("")
    else:
        (root / "latest").write_text("global_step6")
    # a damaged step 4 falls back to step 2; a damaged latest to the newest whole folder, step 4
    want = "global_step2" if damage in ("cut", "missing_rank") else "global_step4"
    args = build_parser_and_parse(_argv(tmp_path / "ckpt"))
    before = (root / "latest").read_text()
    assert resume_point(args, repair=False).tag == want
    assert (root / "latest").read_text() == before  # repair=False leaves it
    point = resume_point(args)
    assert (point.tag, point.step) == (want, int(want[-1]))
    assert why in point.note and f"the newest whole checkpoint {want} is loaded" in point.note
    assert (root / "latest").read_text() == want
    # the whole one loads as DeepSpeed would read it (a real torch file); the cut one does not
    assert torch.load(root / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt")["optimizer_state_dict"]
    if damage == "cut":
        with pytest.raises(Exception):
            torch.load(optim)


def test_a_relaunch_repairs_latest_before_the_preflight_reads_it(tmp_path):
    """A relaunch of a run whose supervisor died too (the recipes pass --ckpt.load_enable): a dangling ``latest``
    would stop the preflight (exit 2); with --ckpt.auto_resume it is pointed at the last whole checkpoint first.
    Without --ckpt.auto_resume nothing is touched (the preflight then names the problem)."""
    from openrlhf_lpo.cli.preflight.checkpoint import _check_resume

    root = tmp_path / "ckpt" / "_actor"
    _deepspeed_ckpt(root, 2)
    (root / "latest").write_text("global_step4")  # the kill came before step 4's folder was written
    plain = build_parser_and_parse(_argv(tmp_path / "ckpt", "--ckpt.load_enable"))
    assert auto_resume.repair_before_preflight(plain) is None and (root / "latest").read_text() == "global_step4"
    args = build_parser_and_parse(_argv(tmp_path / "ckpt", "--ckpt.load_enable", "--ckpt.auto_resume", "2"))
    note = auto_resume.repair_before_preflight(args)
    assert "latest names 'global_step4': no such folder" in note and (root / "latest").read_text() == "global_step2"
    said = []
    _check_resume(type("Ctx", (), {"args": args, "model": None, "say": staticmethod(said.append)})())
    assert said == [f"resume: {root / 'global_step2'} (DeepSpeed, 2 data-parallel ranks, ZeRO-1/2)"]


def test_a_whole_latest_is_kept_and_nothing_whole_starts_at_step_0(tmp_path):
    root = tmp_path / "ckpt" / "_actor"
    _deepspeed_ckpt(root, 2)
    args = build_parser_and_parse(_argv(tmp_path / "ckpt"))
    assert resume_point(args) == type(resume_point(args))("global_step2", 2, None)
    (root / "global_step2" / "mp_rank_00_model_states.pt").write_bytes(b"")
    point = resume_point(args)
    assert point.tag is None and "no whole checkpoint is left: the run starts at step 0" in point.note
    assert not (root / "latest").exists()  # DeepSpeed then finds no checkpoint and starts fresh


def test_a_megatron_checkpoint_with_unreadable_meta_is_skipped(tmp_path, tiny_model_dir):
    import openrlhf_lpo.megatron.preflight  # noqa: F401  (registers the format)

    root = tmp_path / "ckpt" / "_actor"
    for step, meta in ((2, '{"format": "x"}'), (4, '{"format": ')):
        (root / f"global_step{step}").mkdir(parents=True)
        (root / f"global_step{step}" / "meta.json").write_text(meta)
    (root / "latest").write_text("global_step4")
    argv = _argv(tmp_path / "ckpt", "--backend", "megatron")
    argv[argv.index("unused")] = str(tiny_model_dir)
    args = build_parser_and_parse(argv)
    point = resume_point(args)
    assert point.tag == "global_step2" and "meta.json cannot be read" in point.note


@pytest.mark.parametrize("extra, message", [
    (["--ckpt.auto_resume", "-1"], "--ckpt.auto_resume -1: give a number of restarts >= 0"),
    (["--ckpt.auto_resume", "2", "--ckpt.save_steps", "-1"], "--ckpt.save_steps -1 saves none"),
    (["--ckpt.auto_resume", "2", "--ckpt.max_num", "1"], "keep at least 2 (--ckpt.max_num 2)"),
    (["--ckpt.auto_resume", "2", "--ckpt.auto_resume_delay", "-3"], "--ckpt.auto_resume_delay -3.0: give seconds"),
    (["--ckpt.auto_resume", "2", "--ckpt.auto_resume_wait", "-1"],
     "--ckpt.auto_resume_wait -1.0: give seconds >= 0 (0: a restart that finds the cluster without the GPUs"),
])
def test_bad_auto_resume_flags_are_refused(tmp_path, capsys, extra, message):
    with pytest.raises(SystemExit) as exc:
        build_parser_and_parse(_argv(tmp_path / "ckpt", *extra))
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_the_dry_run_states_the_policy(tmp_path, capsys):
    from openrlhf_lpo.cli.train_ppo_ray import main

    main(_argv(tmp_path / "ckpt", "--ckpt.auto_resume", "3", "--dry-run", "--preflight", "off"))
    assert ("auto-resume: a run that dies (lost Ray worker, node or driver) restarts from its last complete "
            "checkpoint (every 2 steps, 3 kept), up to 3 times in a row from one checkpoint, 10 s apart; a restart "
            "waits up to 1800 s for the GPUs of a lost node (not counted as a failure)") in capsys.readouterr().out


def test_the_cause_is_the_signal_or_the_last_exception_line():
    tail = ["Traceback (most recent call last):", "  File x", "ValueError: first",
            "(raylet) ray.exceptions.ActorDiedError: The actor died unexpectedly before finishing this task.",
            "some progress line"]
    assert auto_resume.failure_cause(1, tail) == ("exit 1: ray.exceptions.ActorDiedError: The actor died "
                                                  "unexpectedly before finishing this task.")
    assert auto_resume.failure_cause(-9, tail) == "killed by SIGKILL"
    assert auto_resume.failure_cause(137, []) == "killed by SIGKILL"  # a shell's 128 + 9
    assert auto_resume.failure_cause(1, ["no error here"]) == "exit 1 (no exception in the last 1 lines of output)"


# ----------------------------------------------------------------------------- a restart waits for the GPUs


class _Cluster:
    """What ``capacity.cluster_gpus`` would report, look after look (``frames``: per look, per node
    ``(total, free, memory_free)``), on a clock that the waiting itself advances."""

    def __init__(self, frames):
        self.frames, self.looks, self.now, self.slept = frames, 0, 0.0, []

    def look(self):
        from openrlhf_lpo.cli.capacity import NodeGPUs

        frame = self.frames[min(self.looks, len(self.frames) - 1)]
        self.looks += 1
        return [NodeGPUs(f"10.0.0.{i} (n{i})", *node) for i, node in enumerate(frame)]

    def sleep(self, s):
        self.slept.append(s)
        self.now += s


def _wait(tmp_path, frames, budget=1800.0, backend_args=()):
    from openrlhf_lpo.cli import capacity

    args = build_parser_and_parse(_argv(tmp_path / "ckpt", "--vllm.num_engines", "1", "--algo.kl.init_coef", "0",
                                        *backend_args))
    c, logs = _Cluster(frames), []
    try:
        waited = capacity.wait_for_gpus(args, budget, c.look, logs.append, clock=lambda: c.now, sleep=c.sleep)
    except capacity.ClusterTooSmall as e:
        return c, logs, e
    return c, logs, waited


def test_a_restart_waits_until_the_lost_node_is_back_and_its_gpus_are_free(tmp_path):
    """The run needs 3 GPUs (actor 2, one engine). Lost node: 1 GPU left; back after 4 looks but its GPUs still
    held by Ray (the dead attempt's actors), then their memory still in use on 2 of them (nvidia-smi), then free.
    The pauses grow 1, 2, 4, 8, 10 s; one log line, naming the flag; the waiting returns the seconds waited."""
    lost, back_held, back_memory, free = [(1, 1, None)], [(1, 1, None), (4, 0, None)], \
        [(1, 1, None), (4, 4, 1)], [(1, 1, None), (4, 4, 4)]
    c, logs, waited = _wait(tmp_path, [lost] * 4 + [back_held, back_memory, free])
    assert c.looks == 7 and c.slept == [1, 2, 4, 8, 10, 10] and waited == 35
    assert len(logs) == 1 and logs[0].startswith("waiting for the GPUs (free per node: 10.0.0.0 (n0): 1 of 1 free): ")
    assert "needs 3 GPUs (actor 2, vLLM engines 1) but the Ray cluster has 1" in logs[0]
    assert "up to 1800 s more (--ckpt.auto_resume_wait); waiting is not a failed attempt" in logs[0]


def test_a_restart_that_waits_too_long_stops_naming_the_flag_and_the_nodes(tmp_path):
    from openrlhf_lpo.cli import capacity

    c, logs, err = _wait(tmp_path, [[(4, 4, 1)]], budget=150)
    assert isinstance(err, capacity.ClusterTooSmall) and c.now == 150  # the last pause ends at the budget
    assert len(logs) == 3  # at 0 s, then once a minute
    assert str(err).startswith("the GPUs the run needs did not come back within --ckpt.auto_resume_wait 150 s: ")
    assert "Free GPUs per node: 10.0.0.0 (n0): 1 of 4 free, memory in use on 3 of the free ones." in str(err)
    c, logs, err = _wait(tmp_path, [[(4, 1, None)]], budget=0)  # 0: no wait at all
    assert isinstance(err, capacity.ClusterTooSmall) and c.slept == [] and logs == []


def test_a_megatron_restart_waits_for_a_node_that_holds_a_whole_tp_group(tmp_path, tiny_model_dir):
    """1 + 1 free GPUs do not hold a TP2 group (3 GPUs are enough for DeepSpeed's count): the Megatron fit
    places each block on one node."""
    import openrlhf_lpo.megatron.flags  # noqa: F401  (registers the fit)

    argv = ["--backend", "megatron", "--megatron.tp", "2", "--actor.model_name_or_path", str(tiny_model_dir)]
    c, logs, waited = _wait(tmp_path, [[(2, 1, None), (2, 1, None), (1, 1, None)]] * 2 +
                            [[(2, 2, None), (2, 1, None), (1, 1, None)]], backend_args=argv)
    assert c.looks == 3 and waited == 3 and "no node has 2 free GPUs left for a Megatron actor TP group" in logs[0]


def test_nvidia_smi_memory_rows_are_read_per_gpu():
    from openrlhf_lpo.cli import capacity

    rows = capacity.parse_memory_used("0\n81234\n 1024 \n\n")
    assert rows == [0, 81234, 1024]
    assert sum(1 for mib in rows if mib <= capacity.FREE_MIB) == 2
