"""torch.distributed support: quantized weights shard as packed storage (tensor parallel with DTensor,
FSDP2 ``fully_shard``, expert parallelism of MoE expert stacks). Importing this package registers the ops
torch.distributed calls."""
from .shard_ops import ShardingError, shard_multiple
from . import expert_shards  # noqa: F401  (registers the ops of expert stacks)
from .expert_parallel import parallelize_experts_
