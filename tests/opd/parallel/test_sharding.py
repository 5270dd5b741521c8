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


def test_misspelt_logical_axis_in_rules_is_refused():
  # Before: the typo was accepted and 'vocab' (left without a rule) silently replicated.
  typo = tuple(("vocabb", m) if n == "vocab" else (n, m) for n, m in sharding.DEFAULT_RULES)
  with pytest.raises(ValueError, match=r"logical axis 'vocabb'.*known logical axes: \('batch'"):
    sharding.validate_rules(typo)
  with pytest.raises(ValueError, match="must be \\(logical_name, mesh_axes\\)"):
    sharding.validate_rules(("ab",))


def test_logical_axis_without_rule_is_refused():
  mesh = sharding.make_mesh((1, 4, 2))
  no_vocab = tuple(r for r in sharding.DEFAULT_RULES if r[0] != "vocab")
  # Before: P(None, 'fsdp'), the vocab dim replicated without a word.
  with pytest.raises(ValueError, match=r"embedding: logical axis 'vocab' has no sharding rule"):
    sharding.logical_to_sharding(P("vocab", "embed"), (8, 8), mesh, no_vocab, "embedding")
  no_batch = tuple(r for r in sharding.DEFAULT_RULES if r[0] != "batch")
  with pytest.raises(ValueError, match="logical axis 'batch' has no sharding rule"):
    sharding.batch_sharding(mesh, no_batch)


def test_every_logical_axis_of_the_model_has_a_default_rule():
  # LOGICAL_AXES must cover every name the decoder's parameters carry, or
  # validate_rules would refuse a rule the model needs.
  from opd.models import ModelConfig, param_logical_axes
  cfg = ModelConfig(vocab_size=64, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32,
                    qk_norm=True, qkv_bias=True, o_bias=True, scalar_head=True)
  specs = jax.tree.leaves(param_logical_axes(cfg), is_leaf=lambda x: isinstance(x, P))
  used = {a for spec in specs for a in spec if a is not None}
  assert used <= set(sharding.LOGICAL_AXES), used - set(sharding.LOGICAL_AXES)


@pytest.mark.parametrize("shape,rules,shards", [
    ((2, 2, 2), sharding.DEFAULT_RULES, 4),  # batch -> (data, fsdp): 2 * 2
    ((8, 1, 1), sharding.DEFAULT_RULES, 8),
    ((2, 2, 2), (("batch", "data"),), 2),
    ((1, 1, 8), sharding.DEFAULT_RULES, 1),  # tensor only: every batch divides
])
def test_check_batch_divisible(shape, rules, shards):
  mesh = sharding.make_mesh(shape)
  assert sharding.batch_shards(mesh, rules) == shards
  # Brute force: every size up to 3 shards' worth is accepted iff shards divides it.
  for batch in range(1, 3 * shards + 1):
    if batch % shards == 0:
      assert sharding.check_batch_divisible(batch, mesh, rules) == shards
    else:
      with pytest.raises(ValueError, match=(rf"config\.train\.batch_size={batch} is not divisible "
                                            rf"by the {shards} batch shards of mesh")):
        sharding.check_batch_divisible(batch, mesh, rules, field="config.train.batch_size")


@pytest.mark.parametrize("bad", [0, -4, 2.0, True, "8"])
def test_check_batch_divisible_rejects_non_positive_ints(bad):
  with pytest.raises(ValueError, match=r"config\.rl\.batch_size=.* must be a positive int"):
    sharding.check_batch_divisible(bad, sharding.make_mesh((8, 1, 1)), field="config.rl.batch_size")
