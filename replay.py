"""Rebuild HEAD + only my edits for shared files; print to /tmp/mine/<name>."""
import subprocess, sys
def head(p): return subprocess.run(["git","show",f"HEAD:{p}"],capture_output=True,text=True,check=True).stdout
def rep(s, old, new):
  assert s.count(old)==1, old[:80]; return s.replace(old,new)
out = {}
# ---- config.py
cur = open("opd/models/config.py").read()
s = head("opd/models/config.py")
# MLAConfig class: take it verbatim from the working file
start = cur.index("@dataclasses.dataclass(frozen=True)\nclass MLAConfig:")
end = cur.index("@dataclasses.dataclass(frozen=True)\nclass ModelConfig:")
s = rep(s, "@dataclasses.dataclass(frozen=True)\nclass ModelConfig:", cur[start:end] + "@dataclasses.dataclass(frozen=True)\nclass ModelConfig:")
i0 = cur.index("    remat: rematerialise each block in the backward pass.\n    mla:")
i1 = cur.index('  """', i0)
mla_doc = cur[cur.index("    mla:", i0):cur.index("    moe:", i0) if "    moe:" in cur[i0:i1] else i1]
s = rep(s, '''    remat: rematerialise each block in the backward pass.
  """''', '''    remat: rematerialise each block in the backward pass.
''' + mla_doc + '''  """''')
s = rep(s, '''  remat: bool = False

  def __post_init__(self):''','''  remat: bool = False
  mla: MLAConfig | None = None

  def __post_init__(self):''')
s = rep(s, '''    set_field(self, "head_dim", check_int("ModelConfig", "head_dim", self.head_dim, min_value=1,
                                          allow_none=True))
    if self.head_dim is None and self.d_model % self.n_heads:''','''    set_field(self, "head_dim", check_int("ModelConfig", "head_dim", self.head_dim, min_value=1,
                                          allow_none=True))
    if self.mla is not None:
      self._check_mla()
    else:
      self._check_gqa()

  def _check_gqa(self):
    if self.head_dim is None and self.d_model % self.n_heads:''')
a = cur.index("  def _check_mla(self):")
b = cur.index("  @property\n  def compute_dtype")
s = rep(s, '''  @property
  def resolved_head_dim(self) -> int:
    return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads

''', cur[a:b])
s = rep(s, '''    H, K, Dh = self.n_heads, self.n_kv_heads, self.resolved_head_dim
    attn = D * H * Dh + 2 * D * K * Dh + H * Dh * D
    if self.qkv_bias:''','''    H, K, Dh = self.n_heads, self.n_kv_heads, self.resolved_head_dim
    attn = self._attn_params()
    if self.qkv_bias:''')
s = rep(s, '''    H, K, Dh = self.n_heads, self.n_kv_heads, self.resolved_head_dim
    proj = 2 * (D * H * Dh + 2 * D * K * Dh + H * Dh * D)
    mlp = 2 * 3 * D * F
    attn = 2 * 2 * H * Dh * seq_len  # QK^T and PV against seq_len keys''','''    H, Dh = self.n_heads, self.resolved_head_dim
    proj = 2 * (self._attn_params() - (0 if self.mla is None else self.mla.kv_lora_rank + (
        self.mla.q_lora_rank or 0)))  # matmul weights only (not the latent norms' scales)
    mlp = 2 * 3 * D * F
    Dv = Dh if self.mla is None else self.mla.v_head_dim
    attn = 2 * H * (Dh + Dv) * seq_len  # QK^T and PV against seq_len keys''')
out["config.py"] = s
# ---- decoder.py
s = head("opd/models/decoder.py")
s = rep(s, '''    k, v: tuples of ``n_layers`` arrays ``[B, K, S, Dh]`` (kv heads before
      slots: a decode step reads each head's slots contiguously).''','''    k, v: tuples of ``n_layers`` arrays ``[B, K, S, Dh]`` (kv heads before
      slots: a decode step reads each head's slots contiguously). With
      multi-head latent attention (``cfg.mla``) ``k`` holds the compressed
      latent ``[B, 1, S, C]`` and ``v`` the shared RoPE key ``[B, 1, S, Dr]``
      (``opd.models.mla``).''')
s = rep(s, '''  dtype = dtype or cfg.compute_dtype
  shape = (batch, cfg.n_kv_heads, max_length, cfg.resolved_head_dim)  # [B, K, S, Dh]
  zeros = tuple(jnp.zeros(shape, dtype) for _ in range(cfg.n_layers))
  return KVCache(k=zeros, v=tuple(jnp.zeros(shape, dtype) for _ in range(cfg.n_layers)),''','''  dtype = dtype or cfg.compute_dtype
  shape = (batch, cfg.n_kv_heads, max_length, cfg.resolved_head_dim)  # [B, K, S, Dh]
  v_shape = shape
  if cfg.mla is not None:  # the latent [B, 1, S, C] and the RoPE key [B, 1, S, Dr]
    shape = (batch, 1, max_length, cfg.mla.kv_lora_rank)
    v_shape = (batch, 1, max_length, cfg.mla.qk_rope_head_dim)
  zeros = tuple(jnp.zeros(shape, dtype) for _ in range(cfg.n_layers))
  return KVCache(k=zeros, v=tuple(jnp.zeros(v_shape, dtype) for _ in range(cfg.n_layers)),''')
s = rep(s, '''    attn_out, new_cache = Attention(cfg, name="attn")(norm("attn_norm")(x), positions,
                                                       key_mask, layer_cache)''','''    if cfg.mla is None:
      attn_cls = Attention
    else:
      from opd.models.mla import MLAttention  # mla builds on this module's layers
      attn_cls = MLAttention
    attn_out, new_cache = attn_cls(cfg, name="attn")(norm("attn_norm")(x), positions,
                                                     key_mask, layer_cache)''')
out["decoder.py"] = s
# ---- DESIGN.md
cur = open("docs/DESIGN.md").read()
anchor = '''- **Precision.** fp32 master parameters and optimizer moments; the model
  casts to its compute dtype inside `apply`.
'''
a = cur.index("### Multi-head latent attention")
b = cur.index("a logged warning.\n", a) + len("a logged warning.\n")
s = head("docs/DESIGN.md")
s = rep(s, anchor, anchor + "\n" + cur[a:b])
out["DESIGN.md"] = s
for k, v in out.items():
  open(f"/tmp/mine/{k}", "w").write(v)
print("ok")
