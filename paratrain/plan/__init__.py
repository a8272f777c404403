"""`paratrain plan`: predict per-rank memory and step time of every strategy.

    cluster.py       what the machines can do: presets and calibrated files
    comm_model.py    the alpha-beta time of each collective, per algorithm
    model_source.py  the model named on the command line, built on the meta device
    model_probe.py   one fake forward and backward: FLOPs, saved activations, parameters
    repeated_blocks.py  a stack of L identical blocks counted from copies with 1 and 2
    memory.py        each strategy's bytes per rank, from the strategies' own layout functions
    traffic.py       what each strategy sends per step, from the same layouts
    step_time.py     compute, exposed communication and bubble of one step
    memory_table.py, recommend.py   the tables, the plan to use, what would make a model fit
    calibrate.py     measure this machine (matmul FLOP/s, collective α and β)
    plan_cli.py      the `paratrain plan` subcommand and its JSON schema
"""
