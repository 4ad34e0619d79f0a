"""Names of the environment variables a plan writes into its engines' environment.

They belong to the plan, not to whoever starts the processes: the planner writes them
(``allocate.plan``), the launchers (:mod:`areal_npu.launch`) write the same ones when no plan is
made (one node, ``launch.cpu_binding``), and the engine server reads them at start. Variables only
a launcher sets (the Ray launcher's engine spec) live with that launcher.
"""

#: The CPU cores an engine's whole process group runs on (server, engine core, workers); the engine
#: server applies it to itself at start, before vLLM spawns anything.
ENGINE_CPUS_ENV = "AREAL_ENGINE_CPUS"
#: vLLM's CPU backend: the cores its OpenMP threads bind to (one list per tp rank, ``|``-separated).
OMP_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
