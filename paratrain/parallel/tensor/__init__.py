"""Tensor parallelism: layers cut across ranks (layers.py, ops.py), the plan saying which
(plan.py, parallelize.py), and `Mesh`, the strategy composing it with data parallelism (mesh.py)."""

from paratrain.parallel.tensor.layers import ColwiseLinear, RowwiseLinear, VocabEmbedding
from paratrain.parallel.tensor.mesh import Mesh, TensorParallelModel
from paratrain.parallel.tensor.parallelize import parallelize
from paratrain.parallel.tensor.plan import Plan, plan_for

__all__ = ["ColwiseLinear", "RowwiseLinear", "VocabEmbedding", "Mesh", "TensorParallelModel", "parallelize",
           "Plan", "plan_for"]
