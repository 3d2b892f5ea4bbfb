"""The cluster path: the actor trained by OpenRLHF (Ray + DeepSpeed + vLLM), the experience service
as a Ray actor (``crl_train.service.ray_actor``). See ``docs/cluster.md``.

Modules, lightest first (importing this package imports none of them):

* ``config`` — the ``openrlhf:`` section of a cluster preset; ``settings`` — the run as the Ray
  processes read it (one environment variable); ``tasks`` — dataset labels and the
  guided/free split;
* ``advantages`` / ``steps`` — the split-subgroup advantage mixin and the trainer's ``end_step``
  mixin (no OpenRLHF import: tested on CPU);
* ``executor`` / ``agent`` — our env and wrappers behind OpenRLHF's agent mode (needs the
  ``openrlhf`` package, which imports on CPU);
* ``trainer`` — OpenRLHF's trainer actors with the two mixins (needs OpenRLHF's CUDA stack);
* ``launcher`` — ``crl-train --backend openrlhf``: the command line, the resource plan, the start.
"""
