"""Our Pallas kernels: sliding-window flash attention (forward and backward; a Hopper Mosaic
GPU forward and an opt-in Hopper backward), fused LayerNorm and RMSNorm (+ residual add), fused bias + GeLU and SwiGLU.

Each is tested against the XLA code it replaces (interpret mode on CPU) and reached from the
model through `megajax.layers` (attention: `ATTENTION_IMPLS["pallas"]`).

  attention.py         the portable (Triton) forward, dq and dk/dv kernels, custom_vjp, dispatch
  attention_hopper.py  the Hopper forward (TMA ring, wgmma, warp specialization)
  attention_hopper_backward.py  the Hopper backward, dq and dk/dv (opt-in: backward="mosaic")
  band.py              the band geometry: which KV / query blocks a window (and, for packed rows,
                       the documents) make each program visit
  layer_norm.py, gelu.py, swiglu.py  the fused operators
  support.py           what the kernels share: interpret mode on CPU (lowering_for: traced for
                       another platform), Triton params, output types
"""

from megajax.layers.kernels.attention import default_backend, pallas_attention, pallas_attention_with_lse
from megajax.layers.kernels.gelu import fused_bias_gelu
from megajax.layers.kernels.layer_norm import fused_layer_norm, fused_rms_norm
from megajax.layers.kernels.support import lowering_for
from megajax.layers.kernels.swiglu import fused_swiglu

__all__ = ["default_backend", "fused_bias_gelu", "fused_layer_norm", "fused_rms_norm", "fused_swiglu",
           "lowering_for", "pallas_attention", "pallas_attention_with_lse"]
