"""How a run uses the CPU: torch's threads (:mod:`marl.cpu.threads`, ``--threads``) and how freed memory goes
back to the system (:mod:`marl.cpu.allocator`, ``--cpu_allocator``)."""
