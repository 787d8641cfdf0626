"""Storage types of LoRA factors, shared by the encoder pool, the server settings and the benchmarks.

Factors are stored in one of :data:`FACTOR_NAMES` and always multiplied in float32; half
precision halves a LoRA encoder's memory. A server stores them as :data:`SERVING_FACTORS` unless
told otherwise (``qswap serve --lora-factors``): float16 keeps 10 mantissa bits to bfloat16's 7,
and was chosen by ``qswap bench forward``'s quality rows (docs/query-path.md).
"""

from __future__ import annotations

FACTOR_NAMES = ("float32", "float16", "bfloat16")
SERVING_FACTORS = "float16"
