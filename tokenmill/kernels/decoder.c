// The whole decoder stack of a Llama-lineage model (Gemma 3's options included) in one native call: for every layer the same kernels, in the
// same order, as model/llama.py calls one by one (so the results are bit-identical to that path), but without
// ~10 Python-level calls, ctypes conversions and tensor allocations per layer. At batch 1 those cost ~2 ms of a
// ~10 ms step on a 30-layer model. Each projection is int8 (the grouped kernel) or a GGUF file's own blocks.
//
// It includes the kernel sources, so it is built as one library with them (kernels/build.py hashes every
// source in this directory into the build key).
#include "layer_ops.c"
#include "int8_rows.c"
#include "paged_attention.c"
#include "gguf_matmul.c"
#include "gguf_panels.c"
#include "lora.c"

// One projection: int8 weights packed by int8_pack with per-output-channel scales, or (packed NULL) the stacked
// GGUF tensors of a kernels.GGUFMatmulPlan: the file's blocks gguf_matmul reads, or (panels 1) the same tensors
// repacked by gguf_panels_pack.
typedef struct {
    const int8_t *packed;
    const float *scale;
    int64_t parts;
    const int *types;
    const uint8_t *const *weights;
    const int64_t *rows;
    const int64_t *const *row_index;
    int64_t panels;
    const LoRAWeights *lora;  // the adapters' parts on this projection, or NULL
} Linear;

typedef struct {
    const float *input_norm, *post_norm;  // [hidden] RMSNorm weights
    Linear qkv, o, gate_up, down;
    const float *qkv_bias;  // [q + 2 kv] or NULL
    void *k_cache, *v_cache;
    uint16_t *k_scale, *v_scale;  // 8-bit caches: a bf16 scale per token and KV head (else NULL)
    const float *k_channel;  // int8 caches: the keys' channel scales [kv_heads, head_dim] (else NULL)
    const float *q_norm, *k_norm;  // [head_dim] QK-norm weights (Gemma 3, Qwen3), or NULL
    const float *attn_out_norm, *mlp_out_norm;  // [hidden] Gemma's sandwich norms, or NULL
    int64_t window;  // > 0: a sliding-window layer (keys a query sees, itself included)
    int64_t local_rope;  // 1: rotates with the local tables (Gemma 3's windowed layers)
} DecoderLayer;

// out [tokens, n] = x [tokens, k] @ W.T (+ bias), as Int8Linear / GGUFLinear compute it
static void base_linear(const Linear *w, const float *x, int64_t tokens, int64_t k, const float *bias, float *out,
                        int64_t n) {
    if (w->packed) {
        int8_linear_grouped(x, tokens, k, k, w->packed, w->scale, bias, out, n);
        return;
    }
    int8_t *q = malloc((size_t)(tokens * k));
    float *scales = malloc(sizeof(float) * (size_t)(tokens * k / 32));
    int32_t *corr = malloc(sizeof(int32_t) * (size_t)(tokens * k / 32));
    quantize_groups(x, tokens, k, k, q, scales, corr);
    if (w->panels)
        gguf_panels_matmul(w->parts, w->types, w->weights, w->rows, k, q, scales, corr, tokens, bias, out, n);
    else
        gguf_matmul(w->parts, w->types, w->weights, w->rows, w->row_index, k, q, scales, corr, tokens, bias, out, n);
    free(q);
    free(scales);
    free(corr);
}

// base_linear, plus the LoRA deltas of the step's rows (lora: its rows by adapter; NULL: none), as model/llama.py
// adds them after the projection
static void linear(const Linear *w, const float *x, int64_t tokens, int64_t k, const float *bias, float *out,
                   int64_t n, const LoRABatch *lora) {
    base_linear(w, x, tokens, k, bias, out, n);
    if (lora != NULL && w->lora != NULL) lora_add(w->lora, lora, x, k, out, n);
}

// residual [tokens, hidden]: the embeddings in, the residual stream out (updated in place, as in llama.py);
// x_out [tokens, hidden]: the last layer's MLP output. The caller adds and normalizes the two (the final norm).
// work: tokens * (hidden + qkv + 2 * q + hidden + 3 * intermediate) floats. cos/sin and local_cos/local_sin:
// [tokens, head_dim] rope rows of the layers with and without local_rope; gelu: GeGLU instead of SwiGLU.
void decoder_forward(const DecoderLayer *layers, int64_t num_layers, int64_t tokens, int64_t hidden,
                     int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t intermediate, float eps,
                     float *residual, float *x_out, float *work, const float *cos, const float *sin,
                     const float *local_cos, const float *local_sin, const int64_t *slots, int64_t block_size,
                     const int64_t *query_start, const int64_t *seq_lens, const int64_t *block_tables,
                     int64_t num_seqs, int64_t max_blocks, float scale, int64_t kv_kind, int64_t gelu,
                     const LoRABatch *lora) {
    const int64_t q_width = heads * head_dim, qkv_width = (heads + 2 * kv_heads) * head_dim;
    float *h = work, *qkv = h + tokens * hidden, *q = qkv + tokens * qkv_width, *attn = q + tokens * q_width;
    float *o = attn + tokens * q_width, *gate_up = o + tokens * hidden, *act = gate_up + tokens * 2 * intermediate;
    for (int64_t i = 0; i < num_layers; ++i) {
        const DecoderLayer *layer = layers + i;
        add_rms_norm(residual, i == 0 ? NULL : x_out, hidden, layer->input_norm, eps, h, tokens, hidden);
        linear(&layer->qkv, h, tokens, hidden, layer->qkv_bias, qkv, qkv_width, lora);
        if (layer->q_norm) {
            rms_norm_heads(qkv, qkv_width, tokens, heads, head_dim, layer->q_norm, eps);
            rms_norm_heads(qkv + q_width, qkv_width, tokens, kv_heads, head_dim, layer->k_norm, eps);
        }
        rope_and_cache(qkv, qkv_width, tokens, heads, kv_heads, head_dim, layer->local_rope ? local_cos : cos,
                       layer->local_rope ? local_sin : sin, slots, block_size, layer->k_cache, layer->v_cache,
                       layer->k_scale, layer->v_scale, layer->k_channel, q, kv_kind);
        paged_attention(attn, q, layer->k_cache, layer->v_cache, layer->k_scale, layer->v_scale, query_start,
                        seq_lens, block_tables, num_seqs, max_blocks, heads, kv_heads, head_dim, block_size, q_width,
                        q_width, scale, kv_kind, layer->window);
        linear(&layer->o, attn, tokens, q_width, NULL, o, hidden, lora);
        if (layer->attn_out_norm) add_rms_norm(o, NULL, 0, layer->attn_out_norm, eps, o, tokens, hidden);
        add_rms_norm(residual, o, hidden, layer->post_norm, eps, h, tokens, hidden);
        linear(&layer->gate_up, h, tokens, hidden, NULL, gate_up, 2 * intermediate, lora);
        (gelu ? gelu_tanh_and_mul : silu_and_mul)(gate_up, tokens, intermediate, act);
        linear(&layer->down, act, tokens, intermediate, NULL, x_out, hidden, lora);
        if (layer->mlp_out_norm) add_rms_norm(x_out, NULL, 0, layer->mlp_out_norm, eps, x_out, tokens, hidden);
    }
}
