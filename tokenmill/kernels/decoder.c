// The whole decoder stack of an int8 Llama-family model in one native call: for every layer the same kernels,
// in the same order, as model/llama.py calls one by one (so the results are bit-identical to that path), but
// without ~10 Python-level calls, ctypes conversions and tensor allocations per layer. At batch 1 those cost
// ~2 ms of a ~10 ms step on a 30-layer model.
//
// It includes the kernel sources, so it is built as one library with them (kernels/__init__.py hashes every
// source in this directory into the build key).
#include "layer_ops.c"
#include "int8_rows.c"
#include "paged_attention.c"

typedef struct {
    const float *input_norm, *post_norm;  // [hidden] RMSNorm weights
    const int8_t *qkv, *o, *gate_up, *down;  // weights packed by pack_vnni
    const float *qkv_scale, *o_scale, *gate_up_scale, *down_scale;  // per output channel
    const float *qkv_bias;  // [q + 2 kv] or NULL
    void *k_cache, *v_cache;
} DecoderLayer;

// residual [tokens, hidden]: the embeddings in, the residual stream out (updated in place, as in llama.py);
// x_out [tokens, hidden]: the last layer's MLP output. The caller adds and normalizes the two (the final norm).
// work: tokens * (hidden + qkv + 2 * q + hidden + 3 * intermediate) floats.
void decoder_forward(const DecoderLayer *layers, int64_t num_layers, int64_t tokens, int64_t hidden,
                     int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t intermediate, float eps,
                     float *residual, float *x_out, float *work, const float *cos, const float *sin,
                     const int64_t *slots, int64_t block_size, const int64_t *query_start, const int64_t *seq_lens,
                     const int64_t *block_tables, int64_t num_seqs, int64_t max_blocks, float scale,
                     int64_t kv_bf16) {
    const int64_t q_width = heads * head_dim, qkv_width = (heads + 2 * kv_heads) * head_dim;
    float *h = work, *qkv = h + tokens * hidden, *q = qkv + tokens * qkv_width, *attn = q + tokens * q_width;
    float *o = attn + tokens * q_width, *gate_up = o + tokens * hidden, *act = gate_up + tokens * 2 * intermediate;
    for (int64_t i = 0; i < num_layers; ++i) {
        const DecoderLayer *layer = layers + i;
        add_rms_norm(residual, i == 0 ? NULL : x_out, hidden, layer->input_norm, eps, h, tokens, hidden);
        int8_linear_grouped(h, tokens, hidden, hidden, layer->qkv, layer->qkv_scale, layer->qkv_bias, qkv, qkv_width);
        rope_and_cache(qkv, qkv_width, tokens, heads, kv_heads, head_dim, cos, sin, slots, block_size,
                       layer->k_cache, layer->v_cache, q, kv_bf16);
        paged_attention(attn, q, layer->k_cache, layer->v_cache, query_start, seq_lens, block_tables, num_seqs,
                        max_blocks, heads, kv_heads, head_dim, block_size, q_width, q_width, scale, kv_bf16, 0);
        int8_linear_grouped(attn, tokens, q_width, q_width, layer->o, layer->o_scale, NULL, o, hidden);
        add_rms_norm(residual, o, hidden, layer->post_norm, eps, h, tokens, hidden);
        int8_linear_grouped(h, tokens, hidden, hidden, layer->gate_up, layer->gate_up_scale, NULL, gate_up,
                            2 * intermediate);
        silu_and_mul(gate_up, tokens, intermediate, act);
        int8_linear_grouped(act, tokens, intermediate, intermediate, layer->down, layer->down_scale, NULL, x_out,
                            hidden);
    }
}
