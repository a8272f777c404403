"""What one training step of a model is, counted without running it for real.

    source.py           the model named on the command line, built on the meta device
    fake_step.py        one forward and backward on fake tensors: what lives when
    probe.py            the step's counts: FLOPs, saved activations, parameters, weight copies
    matmuls.py          the step's matmuls by shape, and their time at shape-dependent rates
    block_regions.py    where the work and the saved bytes fall: before, in and after the blocks
    repeated_blocks.py  a stack of L identical blocks counted from copies with 1 and 2
"""
