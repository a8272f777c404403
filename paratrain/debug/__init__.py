"""Finding what went wrong: the collective flight recorder and its hooks, hang reports, the
postmortem of a failed job, and what `paratrain verify` records on each rank."""
