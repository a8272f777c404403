"""Starting a job: `paratrain run` over torch's elastic launcher, and what each rank it starts does
for it (the worker, the CPU allocator's settings)."""
