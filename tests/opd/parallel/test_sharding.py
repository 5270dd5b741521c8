"""opd.parallel.sharding: mesh construction, rule validation, divisibility fallback."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from opd.parallel import sharding


def test_make_mesh_shapes_and_fill():
  assert dict(sharding.make_mesh((2, 2, 2)).shape) == {"data": 2, "fsdp": 2, "tensor": 2}
  assert dict(sharding.make_mesh((-1, 2, 1)).shape) == {"data": 4, "fsdp": 2, "tensor": 1}
  one = sharding.make_mesh((-1, 1, 1), jax.devices()[:1])
  assert one.devices.size == 1


@pytest.mark.parametrize("shape, needle", [
    ((2, 2, 1), "needs 4 devices but 8 are available"),
    ((-1, -1, 1), "at most one -1"),
    ((-1, 3, 1), "not divisible by the fixed axes' product 3"),
    ((0, 8, 1), "must be positive"),
    ((8, 1), "must have 3 entries"),
])
def test_make_mesh_errors(shape, needle):
  with pytest.raises(ValueError, match=needle):
    sharding.make_mesh(shape)


def test_validate_rules_errors():
  with pytest.raises(ValueError, match="names mesh axis 'model'"):
    sharding.validate_rules((("embed", "model"),))
  with pytest.raises(ValueError, match="twice"):
    sharding.validate_rules((("embed", "fsdp"), ("embed", None)))


def test_indivisible_dim_is_replicated_and_logged(caplog):
  mesh = sharding.make_mesh((1, 4, 2))
  with caplog.at_level("WARNING"):
    s = sharding.logical_to_sharding(P("embed", "mlp"), (6, 8), mesh, sharding.DEFAULT_RULES, "w")
  assert s.spec == P(None, "tensor")  # 6 % 4 != 0 -> replicated, 8 % 2 == 0 -> sharded
  assert "not divisible" in caplog.text and "w" in caplog.text


def test_check_sharded_raises_on_large_replicated():
  mesh = sharding.make_mesh((1, 4, 2))
  big = jax.device_put(jnp.zeros((64, 64)), NamedSharding(mesh, P()))
  fine = jax.device_put(jnp.zeros((64, 64)), NamedSharding(mesh, P("fsdp", "tensor")))
  assert fine.sharding.shard_shape(fine.shape) == (16, 32)
  assert sharding.check_sharded({"w": fine}, min_size=1000) == []
  with pytest.raises(ValueError, match=r"\['big'\] \(64, 64\)"):
    sharding.check_sharded({"big": big, "w": fine}, min_size=1000)
  # On a mesh that shards nothing, replication is expected: no error.
  data_only = sharding.make_mesh((8, 1, 1))
  rep = jax.device_put(np.zeros((64, 64)), NamedSharding(data_only, P()))
  assert sharding.check_sharded({"big": rep}, min_size=1000) == ["['big'] (64, 64)"]


def test_batch_sharding_uses_batch_rule():
  mesh = sharding.make_mesh((2, 2, 2))
  s = sharding.batch_sharding(mesh, sharding.DEFAULT_RULES, ndim=3)
  assert s.spec == P(("data", "fsdp"), None, None)
