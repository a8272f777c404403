"""What a step costs under each strategy, read from the strategies' own layout code.

    layouts.py           the strategies' layout functions run on meta stand-ins
    memory.py            each strategy's bytes per rank
    optimizer_state.py   what an element-wise optimizer keeps and makes per tensor
    zero3_backward.py    what a ZeRO-3 backward holds at once, flat by flat
    traffic.py           what each strategy sends per step
    comm_model.py        the alpha-beta time of each collective, per algorithm
    step_time.py         compute, exposed communication and bubble of one step
    schedule_figures.py  a pipeline schedule's idle slots and micro-batches in flight
    tensor_parallel.py, context_parallel.py   what a Mesh's tp and cp change in both
"""
