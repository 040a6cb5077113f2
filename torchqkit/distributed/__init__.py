"""torch.distributed support: quantized weights shard as packed storage (tensor parallel with DTensor,
FSDP2 ``fully_shard``). Importing this package registers the ops torch.distributed calls."""
from .shard_ops import ShardingError, shard_multiple
