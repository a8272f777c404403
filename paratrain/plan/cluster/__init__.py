"""What the machines can do.

    cluster.py            a `Cluster`: nodes, devices per node, the two fabrics, FLOP/s by dtype
    presets.py            the built-in clusters (`--cluster NAME`)
    calibrate.py          `--calibrate OUT.json`: measure this machine and write a cluster file
    calibrate_compute.py  its first phase: matmul and optimizer rates
"""
