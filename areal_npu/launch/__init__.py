"""Starting processes from a plan: the rollout engines, the trainer ranks (torchrun), and both on a
Ray cluster.

* ``engines``        -- :func:`launch_engines`, the trainer's one entry: a run's engines started
  here, or in the Ray launcher's bundles when it set ``RAY_ENGINES_ENV``
* ``engine_process`` -- :class:`EngineProcess`: one vLLM engine process group, health-checked,
  restarted on the cores and port rules of its first start, no orphans
* ``cpu_binding``    -- the cores a CPU engine's whole process group runs on
* ``torchrun``       -- the torchrun command that starts a run's trainer ranks on this node
* ``ray_launch``     -- the Ray launcher (``python -m areal_npu.launch.ray_launch``): reserve one
  placement group per plan node, start the trainer ranks as actors, wait, tear down
* ``ray_bundles``    -- pure: a plan as placement groups, and the cluster ``ray.nodes()`` describes
* ``ray_actors``     -- what runs in the actors: a trainer rank's process group, an engine's
  ``EngineProcess``, the per-process reports
* ``ray_engines``    -- trainer rank 0 starts its engines in their bundles
* ``ray_child``      -- ends a rank's session when its actor dies (standard library only)

Only the ``ray_*`` modules touch Ray, and only inside functions: importing any module here is
cheap without the ``ray`` extra. What the plan writes into a process's environment is named in
:mod:`areal_npu.placement.env`; the names only a launcher sets live beside it (``RAY_ENGINES_ENV``
in ``ray_engines``). Nothing here is imported by the package's init: import the module you need.
"""
