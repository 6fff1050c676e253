/* A step's new K and V rows into their pool slots on the CPU (kv/cpu_store.py; built and
 * loaded by native/build.py): one call per layer instead of a check for unwritten rows,
 * an index conversion and two `index_copy_` (about 60 us a layer for a 16-row decode
 * step on a 2-core AMD EPYC, 2 ms of a 35 ms step).
 *
 * Each token's row (every KV head, `k_bytes` / `v_bytes` contiguous bytes) is copied to
 * its slot; a slot of -1 marks a row that is not written. Source and pool have the same
 * element type (the caller converts otherwise).
 */
#include <stdint.h>
#include <string.h>

/* Returns 0, or the first row whose slot is past the pool's `num_slots` plus one
 * (nothing is written then). */
int64_t svllm_kv_store(const char *k, int64_t k_stride, const char *v, int64_t v_stride,
                       const int64_t *slots, int64_t tokens, int64_t num_slots, char *k_pool,
                       int64_t k_slot, char *v_pool, int64_t v_slot, int64_t k_bytes,
                       int64_t v_bytes) {
    for (int64_t t = 0; t < tokens; t++)
        if (slots[t] >= num_slots) return t + 1;
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        memcpy(k_pool + slot * k_slot, k + t * k_stride, (size_t)k_bytes);
        memcpy(v_pool + slot * v_slot, v + t * v_stride, (size_t)v_bytes);
    }
    return 0;
}
