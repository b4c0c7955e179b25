"""The batch the learner trains on: rollout records -> a data-parallel rank's compact batch, its
balancing across ranks, its mini- and micro-batches.

Below the learner, the reward models and the trainer, which all import it from here:
- `rollout_batch.py`: `RolloutBatch` (storage, padded views, broadcast, save/load), the per-step
  helpers `token_rewards`, `mini_batches`, `check_distinct_topk`;
- `exchange.py`: `rebalance`, point-to-point moves of whole sequences between data-parallel ranks;
- `micro.py`: `plan_micro_batches` and the micro-batch layout (padding, compact routes).
"""

from megatron_rl.batch.rollout_batch import (  # noqa: F401
    RESPONSE_ROWS, RolloutBatch, check_distinct_topk, mini_batches, token_rewards,
)
from megatron_rl.batch.exchange import balance_plan, rebalance  # noqa: F401
from megatron_rl.batch.micro import (  # noqa: F401
    empty_micro_batch, padded_len, padding_waste, plan_micro_batches, route_fill, split_micro_batches,
    widen_routes,
)
from megatron_rl.rollout.records import (  # noqa: F401
    NO_ROUTE_U8, UNKNOWN_VERSION, no_route, route_dtype, version_number,
)
