"""The backend-free LPO core: what both distributed backends (DeepSpeed through OpenRLHF, Megatron) call.

Rooms: :mod:`layout` (groups to ranks, windows, micro-batches), :mod:`update` (one LPO update's plan:
windows, where each window's coefficients come from, the guards, the window shuffle's RNG rule),
:mod:`offpolicy` (the behaviour correction and s_t), :mod:`divergence_schedule`,
:mod:`listwise_metrics` (the ``lpo/*`` metrics) and :mod:`config` (estimator sets, the paired
temperatures, the frozen LPO settings). Pure torch on top of :mod:`openrlhf_lpo.listwise`; nothing here
imports OpenRLHF, megatron-core or another room of the package.
"""
