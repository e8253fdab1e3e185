"""The checks of the shared Megatron gloo world, by concern; ``tests/megatron/mcore_worker.py`` runs them.

Every rank of the world (4 gloo processes, launched by ``conftest.launch_world``) runs the checks of
:data:`ORDER` one after the other (``runner.py``). A check is a function registered by name
(``@check("packing")``, ``registry.py``) that returns the numbers it measured, keyed as the tests read
them; the runner merges them into the rank's record (``OUT/rank{R}.json``: ``checks``) and notes the
check's outcome beside them (``status[name] = {"ok", "error", "seconds"}``). A check that raises fails
alone: the later ones still run. The pytest side (``test_megatron_layouts.py``, ``_training.py``,
``_parallel.py``) asserts each test's own checks' status first (``mcore_records.world_checks``), so a
failure names its check and carries its traceback.

Modules (each registers its checks on import; none is imported by the pytest process but this one):

* ``world.py``         joining the gloo world, the rank's record and its atomic write
* ``references.py``    the references, independent of megatron: a tiny HF model, the shared batch, HF
                       float64 log-probs per unpadded sequence, plain-torch float64 steps
* ``layouts.py``       ``Layout``; log-prob, gradient and update parity per TP / PP / DP layout and
                       architecture, with the negative controls (wrong QKV fusion, RoPE scaling left out)
* ``checkpoints.py``   save / resume of a layout run, checkpoint and HF weight-stream traffic counted
* ``update_maths.py``  update magnitude, recompute, off-policy target, KL and entropy terms, LR
                       schedule, off-policy target through fit, partial PG batches
* ``packing.py``       packed sequences, no S x S tensor, token-budget micro-batches
* ``reshard.py``       checkpoints resumed in another layout, TP groups within nodes
* ``offload.py``       the actor's state to host memory and back (TP2, PP2, distributed optimizer)
* ``weight_ipc.py``    the colocated weight route with the shared-memory stand-in for CUDA IPC vs the NCCL
                       route's export (TP2, PP2, fp32 and bf16)
* ``policy_actor.py``  the Ray policy-actor class driven without Ray, the weight stream to vLLM engines
* ``policy_fit.py``    helpers for driving that class through ``fit`` (no checks of its own)
* ``syncs.py``         host syncs in the loss path, response rows only, our THD RoPE vs megatron's
* ``census.py``        collectives on their group's device, live process groups
* ``parallel.py``      sequence parallelism and virtual pipeline stages (layouts and checkpoints)

Development switches (environment of every rank, see ``runner.py``): ``MCORE_WORKER_SUITE=only:a,b``
runs the named checks alone; ``MCORE_WORKER_FAIL=name`` (or ``name@rank``) makes that check raise at its
start; ``MCORE_WORKER_BARRIER_S`` is the wait at the barrier after each check (default 300 s);
``MCORE_WORKER_STACKS=N`` dumps every rank's stack after N seconds; ``MCORE_PARALLEL_LAYOUTS=a,b``
restricts ``sp_vpp_layouts`` to those layouts.

This file imports nothing: the pytest side reads :data:`ORDER` without joining a world.
"""

# the fixed order of the world's checks (the same sequence as the single worker it replaced: the layout
# checks, the special checks, the collective / process-group census, then sequence parallelism and VPP)
ORDER = (
    "layouts_qwen3_tied",
    "checkpoint_export",
    "layouts_qwen3_untied",
    "layouts_qwen2_untied",
    "layouts_llama_untied",
    "layouts_mistral_untied",
    "update_magnitude",
    "packing",
    "no_sxs",
    "recompute",
    "offpolicy",
    "reshard",
    "offload",
    "weight_ipc",
    "nodes",
    "policy_actor",
    "kl_entropy",
    "lr_schedule",
    "offpolicy_fit",
    "dynamic_batching",
    "pg_partial_batch",
    "syncs_and_rows",
    "census",
    "sp_vpp_layouts",
    "vpp_checkpoints",
)

# the modules that register them (imported by the runner after the rank has joined the world)
MODULES = ("layouts", "checkpoints", "update_maths", "packing", "reshard", "offload", "weight_ipc", "policy_actor", "syncs",
           "census", "parallel")
