"""The sizing tables of docs/SCALING.md, computed from ``opd.parallel.memory``.

``python -m experiments.sizing`` prints, for Qwen3-shaped students (0.6B,
8B, 32B) on 8 chips (TPU v5p, TPU v6e, NVIDIA H200), the mesh layout among
the ``(data, fsdp, tensor)`` splits of 8 that fits the most rows of T tokens
(rows a power of two) within 90% of a chip's HBM, with the per-device bytes,
their three largest terms, the step's FLOPs and its time at 100% / 40% of
the chips' published bf16 peak; then the same for LoRA students. Every
number in those tables comes from here (``--json`` writes them too).

Setting (the tables' title): T = 4096, bf16 compute, rematerialised blocks,
the fused OPD loss, one int8 teacher of the student's shape resident (its
weights ``P`` bytes, its hidden states cached in bf16).
"""
from __future__ import annotations

import argparse
import dataclasses
import json

from opd.models import ModelConfig
from opd.models.lora import LoRAConfig, lora_param_count
from opd.parallel import memory

GIB = 2 ** 30


@dataclasses.dataclass(frozen=True)
class Chip:
  """A chip's published bf16 dense peak (FLOP/s) and HBM (bytes)."""
  name: str
  peak_flops: float
  hbm: int


CHIPS = (Chip("TPU v5p", 459e12, 95 * GIB), Chip("TPU v6e", 918e12, 32 * GIB),
         Chip("H200", 989e12, 141 * 10 ** 9))
_QWEN3 = dict(vocab_size=151936, head_dim=128, n_kv_heads=8, qk_norm=True, dtype="bfloat16",
              remat=True)
STUDENTS = {"0.6B": ModelConfig(**_QWEN3, d_model=1024, n_layers=28, n_heads=16, d_ff=3072,
                                tie_embeddings=True),
            "8B": ModelConfig(**_QWEN3, d_model=4096, n_layers=36, n_heads=32, d_ff=12288),
            "32B": ModelConfig(**_QWEN3, d_model=5120, n_layers=64, n_heads=64, d_ff=25600)}
LAYOUTS = tuple((d, f, t) for d in (8, 4, 2, 1) for f in (8, 4, 2, 1) for t in (1, 2, 4, 8)
                if d * f * t == 8)
FILL = 0.9  # of HBM: headroom for XLA's fragmentation and runtime buffers
MFU = 0.4


def _estimate(cfg: ModelConfig, mesh, rows: int, seq: int, lora: LoRAConfig | None):
  teachers = memory.TeacherMemory(dims=(cfg.d_model,), param_bytes=cfg.num_params())
  return memory.estimate_memory(cfg, mesh, rows, seq, fused_loss=True, teachers=teachers,
                                lora=memory.LoRAMemory(lora) if lora is not None else None)


def best_layout(cfg: ModelConfig, chip: Chip, *, seq: int = 4096, chips: int = 8,
                lora: LoRAConfig | None = None, max_rows: int = 4096) -> dict:
  """The layout of ``LAYOUTS`` fitting the most rows (a power of two, at least
  one per batch shard) within ``FILL`` of ``chip.hbm``; ties go to the smaller
  per-device total (then the more data-parallel layout). Without a fit: the smallest total at one row per shard."""
  best, smallest = None, None
  for mesh in LAYOUTS:
    rows = mesh[0] * mesh[1]
    fits = None
    while rows <= max_rows:
      est = _estimate(cfg, mesh, rows, seq, lora)
      if rows == mesh[0] * mesh[1] and (smallest is None or est.total < smallest[2].total):
        smallest = (mesh, rows, est)
      if est.total > FILL * chip.hbm:
        break
      fits = (mesh, rows, est)
      rows *= 2
    if fits is not None and (best is None or fits[1] > best[1] or
                             (fits[1] == best[1] and fits[2].total < best[2].total)):
      best = fits
  mesh, rows, est = best if best is not None else smallest
  flops = memory.step_flops(cfg, rows, seq)
  return {"chip": chip.name, "fits": best is not None, "mesh": mesh, "rows": rows,
          "seq": seq, "total_gib": est.total / GIB, "hbm_gib": chip.hbm / GIB,
          "top": [(n, v / GIB) for n, v in list(est.terms().items())[:3]],
          "flops": flops, "s_peak": flops / (chips * chip.peak_flops),
          "s_mfu": memory.step_seconds(cfg, rows, seq, chips, chip.peak_flops, MFU)}


def _top(row: dict) -> str:
  return ", ".join(f"{n.replace('_', ' ')} {v:.1f}" for n, v in row["top"])


def full_table() -> tuple[list[str], list[dict]]:
  lines = ["| Student | 8 chips | mesh (data, fsdp, tensor) | rows | per device | FLOPs "
           "| s at peak / 40% |", "|---|---|---|---|---|---|---|"]
  rows = []
  for name, cfg in STUDENTS.items():
    for chip in CHIPS:
      r = best_layout(cfg, chip)
      rows.append({"student": name, **r})
      if r["fits"]:
        lines.append(f"| {name} | {chip.name} | {r['mesh']} | {r['rows']} | "
                     f"{r['total_gib']:.1f} of {r['hbm_gib']:.0f} GiB ({_top(r)}) | "
                     f"{r['flops']:.2e} | {r['s_peak']:.2f} / {r['s_mfu']:.2f} |")
      else:
        lines.append(f"| {name} | {chip.name} | does not fit | – | {r['total_gib']:.0f} GiB at "
                     f"{r['mesh']}, {r['rows']} rows ({_top(r)}) | – | – |")
  return lines, rows


def lora_table(rank: int = 16, alpha: float = 32.0) -> tuple[list[str], list[dict]]:
  lora = LoRAConfig(rank=rank, alpha=alpha)
  lines = ["| Student | 8 chips | mesh | rows | per device |", "|---|---|---|---|---|"]
  rows = []
  for name in ("8B", "32B"):
    cfg = STUDENTS[name]
    trainable = lora_param_count(cfg, lora)
    for chip in CHIPS[:2]:
      r = best_layout(cfg, chip, lora=lora)
      if not r["fits"]:
        r = best_layout(cfg, chip, lora=lora, seq=2048)
      rows.append({"student": name, "trainable": trainable, **r})
      at = "" if r["seq"] == 4096 else f" at T = {r['seq']}"
      lines.append(f"| {name}, r {rank} ({trainable / 1e6:.0f} M trainable) | {chip.name} | "
                   f"{r['mesh'] if r['fits'] else 'does not fit'} | {r['rows']}{at} | "
                   f"{r['total_gib']:.1f} of {r['hbm_gib']:.0f} GiB ({_top(r)}) |")
  return lines, rows


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--json", default=None, help="also write the rows here")
  args = parser.parse_args(argv)
  full_lines, full_rows = full_table()
  lora_lines, lora_rows = lora_table()
  print("\n".join(full_lines + [""] + lora_lines))
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump({"full": full_rows, "lora": lora_rows}, f, indent=1)
  return full_rows, lora_rows


if __name__ == "__main__":
  main()
