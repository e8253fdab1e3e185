"""The training-backend table (openrlhf_lpo/core/training_backends.py): every name ``--backend`` accepts is an entry,
the places that differ by backend read the entry (data-parallel size, checkpoint disk, the flag groups a backend
owns), and a third backend is one registration."""

import itertools
from types import SimpleNamespace as NS

import pytest

from openrlhf_lpo.core import training_backends as tb
from openrlhf_lpo.core.config import dp_size


def _args(backend, nodes=2, gpn=8, tp=1, pp=1, ring=1, ds_tp=1, zero=2, max_num=3):
    return NS(backend=backend, actor=NS(num_nodes=nodes, num_gpus_per_node=gpn), megatron=NS(tp=tp, pp=pp),
              ds=NS(ring_attn_size=ring, tensor_parallel_size=ds_tp, zero_stage=zero, param_dtype="bf16"),
              ckpt=NS(max_num=max_num, save_steps=10, disable_ds=False, save_hf=False, path="/ckpt", output_dir="/out",
                      best_metric_key=""),
              eval=NS(dataset=None))


def test_every_backend_name_is_an_entry():
    assert tb.backend_names() == ["deepspeed", "megatron"]
    assert [tb.training_backend(n).name for n in tb.backend_names()] == ["deepspeed", "megatron"]
    assert tb.backend_of(NS()).name == tb.DEFAULT_BACKEND == "deepspeed"  # a namespace without --backend
    with pytest.raises(ValueError, match="^unknown training backend 'fsdp'; valid: deepspeed, megatron$"):
        tb.training_backend("fsdp")
    with pytest.raises(ValueError, match="^training backend 'megatron' is already registered$"):
        tb.register_training_backend(tb.training_backend("megatron"))


def test_dp_size_is_the_actor_gpus_over_one_replica():
    """DeepSpeed: OpenRLHF's duplicate_actors = ring x TP ranks hold one replica; Megatron: tp x pp (its rank order
    tp-cp-ep-pp-dp): counted as the distinct replicas of the actor's ranks."""
    for nodes, gpn, a, b in itertools.product((1, 2), (2, 4, 8), (1, 2, 4), (1, 2)):
        if (nodes * gpn) % (a * b):  # a layout the flags refuse
            continue
        replicas = lambda block: len({rank // block for rank in range(nodes * gpn)})  # noqa: E731
        assert dp_size(_args("deepspeed", nodes, gpn, ring=a, ds_tp=b)) == replicas(a * b)
        assert dp_size(_args("megatron", nodes, gpn, tp=a, pp=b)) == replicas(a * b)
        assert dp_size(_args("deepspeed", nodes, gpn, tp=a, pp=b)) == nodes * gpn  # --megatron.* are not DeepSpeed's


def test_the_checkpoint_disk_follows_the_entry():
    """cli/disk.py: DeepSpeed keeps --ckpt.max_num checkpoints of fp32 master + Adam (12 B) + the bf16 module (2 B;
    none under ZeRO-3); Megatron writes fp32 parameters + Adam (12 B) before it prunes: max_num + 1."""
    from openrlhf_lpo.cli import disk

    n = 1_000_000

    def checkpoints(args):
        ((what, size, where),) = [p for p in disk.run_disk_need(args, n, None).parts if "checkpoint" in p[0]]
        assert where == "/ckpt"
        return what, size

    assert checkpoints(_args("deepspeed", zero=2)) == ("3 deepspeed checkpoint(s) of 13.4 MiB", 3 * 14 * n)
    assert checkpoints(_args("deepspeed", zero=3)) == ("3 deepspeed checkpoint(s) of 11.4 MiB", 3 * 12 * n)
    assert checkpoints(_args("megatron", zero=2)) == ("4 megatron checkpoint(s) of 11.4 MiB", 4 * 12 * n)


def test_a_third_backend_is_one_registration(monkeypatch):
    """Registered, it is a --backend choice, the data-parallel size and the placement plan read its layout, and a
    flag group bound to it runs for its runs only."""
    from openrlhf_lpo.cli import flags, plan
    from openrlhf_lpo.cli.train_ppo_ray import get_parser
    from openrlhf_lpo.megatron import flags as megatron_flags  # noqa: F401  (registers the Megatron flag groups)
    from openrlhf_lpo.openrlhf.placement import planned_layout

    entry = tb.TrainingBackend(name="fsdp-test", model_parallel=lambda args: (4, 1), layout_note=lambda a, dp: "",
                               checkpoint_holds_weights=lambda args: True, saves_before_pruning=True,
                               deepspeed_optimizer=False, safetensors_only=False, reads_model_config=False,
                               offload_on_cpu=False)
    monkeypatch.setitem(tb.TRAINING_BACKENDS, "fsdp-test", entry)
    (action,) = [a for a in get_parser()._actions if a.dest == "backend"]
    assert action.choices == ["deepspeed", "fsdp-test", "megatron"] and action.default == "deepspeed"
    args = _args("fsdp-test")
    assert dp_size(args) == 16 // 4
    assert plan._placement_lines(args)[1:] == [f"    {line}" for line in planned_layout(2, 8, 4, 1)]  # 4-rank blocks
    bound = lambda name: {g.name for g in flags.flag_groups(NS(backend=name)) if g.backend}  # noqa: E731
    assert bound("fsdp-test") == set() and bound("deepspeed") == set()
    assert bound("megatron") == {"megatron", "megatron-colocation-memory"}
