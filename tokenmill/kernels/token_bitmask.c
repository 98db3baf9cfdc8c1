// Structured outputs: apply a token bitmask to rows of the logits in place (structured_output/bitmask.py).
// Bit t of a row (word t / 32, bit t % 32) set = token t allowed; the others become -inf. Grammar masks are
// mostly whole words of zeros (a JSON grammar allows a few hundred of 49k tokens), so a word is handled whole
// when it is all zeros or all ones, and bit by bit otherwise.
#include <math.h>
#include <stdint.h>

void apply_token_bitmask(float *logits, int64_t logits_stride, const int64_t *rows, int64_t num_rows,
                         const int32_t *bitmask, int64_t words, int64_t vocab) {
    for (int64_t i = 0; i < num_rows; ++i) {
        float *row = logits + rows[i] * logits_stride;
        const uint32_t *mask = (const uint32_t *)(bitmask + i * words);
        for (int64_t w = 0; w < words; ++w) {
            const uint32_t bits = mask[w];
            if (bits == 0xFFFFFFFFu) continue;
            const int64_t first = w * 32, last = first + 32 < vocab ? first + 32 : vocab;
            if (bits == 0) {
                for (int64_t t = first; t < last; ++t) row[t] = -INFINITY;
            } else {
                for (int64_t t = first; t < last; ++t)
                    if (!((bits >> (t - first)) & 1u)) row[t] = -INFINITY;
            }
        }
        for (int64_t t = words * 32; t < vocab; ++t) row[t] = -INFINITY;  // tokens the mask does not cover
    }
}
