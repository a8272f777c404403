"""`paratrain plan`: predict per-rank memory and step time of every strategy.

    model/      what one training step of the model is: built on the meta device, run once on
                fake tensors, its FLOPs, matmul shapes, saved activations and parameters counted
    cluster/    what the machines can do: presets, calibrated files, and `--calibrate` to measure one
    cost/       what a step costs under each strategy, from the strategies' own layout code:
                bytes per rank, bytes sent, the alpha-beta time of each collective, the step's time
    memory_table.py, recommend.py   the tables, the plan to use, what would make a model fit
    search.py   every layout over the mesh that fits, ranked by predicted throughput
    scaling.py  throughput and memory against the number of devices (`--png`)

The command line itself is cli/plan.py. The layers run model/ and cluster/ → cost/ → the tables
(tests/test_architecture.py).
"""
