"""Context parallelism: each sequence cut across the ranks of a cp group (sharding.py), attention
over the whole of it by ring (ring.py) or all-to-all (ulysses.py), routed from the model's own
F.scaled_dot_product_attention calls (routing.py) inside the training step (model.py). `Mesh(cp=)`
(parallel/tensor/mesh.py) composes it with data and tensor parallelism."""

from paratrain.parallel.context.model import ContextParallelModel
from paratrain.parallel.context.ring import ring_attention
from paratrain.parallel.context.routing import positions
from paratrain.parallel.context.ulysses import all_to_all_attention

__all__ = ["ContextParallelModel", "ring_attention", "positions", "all_to_all_attention"]
