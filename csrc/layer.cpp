// Schema of the two halves of a Llama-style decoder layer around its attention, for the loop's forward on the CPU
// (kernel: csrc/cpu/layer.cpp; reference: fastverify/hf/layers.py `_forward`, op for op).
//
//   decoder_pre_attention(h float32 [B, S, E], norm_weight [E], eps, qkv packed [N = (n_q + 2 n_kv) D] (q, d, m,
//                         bits as fastverify.ops.linear.PackedWeight), qkv_bias [N] or None, cos [B or 1, 1, S, D],
//                         sin (as cos), n_q, n_kv) -> (qk [B, n_q + n_kv, S, D], v [B, n_kv, S, D])
//       x = rms_norm(h); qkv = skinny_linear_packed(x) viewed [B, S, n_q + 2 n_kv, D]; q and k rotated together by
//       rotary_embedding (q = qk[:, :n_q], k = qk[:, n_q:]; two outputs of an op may not
//       share memory), v a view of qkv.
//   decoder_post_attention(h [B, S, E], attn float32 [B, S, n_q, D] or [B, S, n_q D] (the attention's output), the output
//                          projection packed and its bias, norm_weight, eps, the stacked gate / up projections packed
//                          [2 I, E] and their bias, the down projection packed and its bias) -> h' [B, S, E]
//       h1 = h + o_proj(attn); h' = h1 + down_proj(silu(gate) * up) with [gate | up] = gate_up(rms_norm(h1)).
//
// Each step is the registered op or the ATen op that the Python forward calls, on the same tensors, so the results
// are the same bits: one call from Python where the Python forward makes about twenty (views, slices, norms,
// projections, the activation, residual additions), which on a small model's one-row step is most of a layer's
// time outside its kernels. Inference only (no autograd); CPU only, float32, packed projections (a GGUF model's):
// anything else runs the Python forward.
#include <torch/library.h>

TORCH_LIBRARY_FRAGMENT(fastverify, m) {
  m.def("decoder_pre_attention(Tensor h, Tensor norm_weight, float eps, Tensor qkv_q, Tensor qkv_d, Tensor qkv_m, "
        "int qkv_bits, Tensor? qkv_bias, Tensor cos, Tensor sin, int n_q, int n_kv) -> (Tensor, Tensor)");
  m.def("decoder_post_attention(Tensor h, Tensor attn, Tensor o_q, Tensor o_d, Tensor o_m, int o_bits, "
        "Tensor? o_bias, Tensor norm_weight, float eps, Tensor gate_up_q, Tensor gate_up_d, Tensor gate_up_m, "
        "int gate_up_bits, Tensor? gate_up_bias, Tensor down_q, Tensor down_d, Tensor down_m, int down_bits, "
        "Tensor? down_bias) -> Tensor");
}
