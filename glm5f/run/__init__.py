"""run: what a run does around its steps -- the memory plan (plan), the checks before the first step
(preflight, resume), the run directory and its config file (rundir, recipe_file), metrics and progress (metrics),
processes and signals (launch, preempt).

The top floor: it may import every folder below; nothing in glm5f imports it but the objectives table's users."""
