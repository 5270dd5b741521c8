"""Meshes, logical-axis sharding rules, multi-process (``jax.distributed``) helpers and the
per-device memory model (``opd.parallel.memory``, docs/SCALING.md)."""
from opd.parallel import distributed, memory, sharding
from opd.parallel.distributed import (batch_shard_count, free_port, gather_to_host, initialize,
                                      initialize_from_env, is_main_process, process_batch_rows,
                                      process_count, process_index, shard_batch, shutdown, sync)
from opd.parallel.memory import (DoesNotFitError, LoRAMemory, MemoryEstimate, RolloutMemory,
                                 TeacherMemory, check_fits, estimate_memory)
from opd.parallel.sharding import (DEFAULT_RULES, LOGICAL_AXES, MESH_AXES, batch_shards,
                                   batch_sharding, check_batch_divisible, check_sharded,
                                   logical_to_sharding, make_mesh, replicated, tree_shardings,
                                   validate_rules)
