"""Where a process sits in the job, its process groups, and the collectives between them."""
