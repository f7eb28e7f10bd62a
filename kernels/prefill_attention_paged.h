/* ms_prefill_attention_paged: prefill_attention.c's kernel reading the paged KV cache in place.
 *
 * Included at the end of prefill_attention.c (its Buffers, KeySource, paged_key_block and
 * attend_item), kept apart to keep that file readable. */

/* The same attention for a group of sequences whose keys and values lie in the paged KV cache
 * ([blocks, block_size, Hkv, D], float32, or int8 codes with float32 scales [blocks, block_size,
 * Hkv]): sequence i's T queries q[i * T .. i * T + T - 1] sit at positions context_lens[i] ..
 * context_lens[i] + T - 1 and see keys 0 .. their own position through block table
 * tables[i * table_stride ..]. Any T >= 1.
 *
 * Why: a row's arithmetic above does not depend on the other rows of its call nor on where its keys
 * were read from, so a token computed here gets the same bits in a chunk of 1, 6 or 500 queries,
 * beside any other sequences, as through ms_prefill_attention. The engine's batch-invariant mode
 * sends every row here. Chunks of one query block (decode rows, short chunks) read their keys a
 * block at a time into the thread's tiles; longer ones gather the sequence once, keys transposed,
 * as ms_prefill_attention's callers lay them out, since every query block reads them all. */
int64_t ms_prefill_attention_paged(const float *q, const void *k_cache, const void *v_cache,
                                   const float *k_scales, const float *v_scales, int64_t kv_int8,
                                   int64_t block_size, const int64_t *tables, int64_t table_stride,
                                   const int64_t *context_lens, int64_t n, int64_t T, int64_t H,
                                   int64_t Hkv, int64_t D, float scale, float *out, int64_t nthreads) {
    if (n < 1 || T < 1 || Hkv < 1 || H % Hkv || H / Hkv > MAX_GROUP || D < 64 || D % 64 || block_size < 1
        || (kv_int8 && (!k_scales || !v_scales)))
        return -1;
    for (int64_t i = 0; i < n; i++)
        if (context_lens[i] < 0) return -1;
    int64_t blocks = (T + QUERY_BLOCK - 1) / QUERY_BLOCK, items = n * Hkv * blocks, failed = 0;
    int gather = blocks > 1;   /* several query blocks read every key: lay them out once */
    int nt = nthreads > 0 ? (int)nthreads : omp_get_max_threads();
    /* Decode rows of sequences enough to keep every thread busy: one item per row, every kv head
     * of a key block in turn (attend_row_all_heads), so a token's keys and values are read
     * together, as the decode kernel reads them. The same bits as an item per kv head. */
    int all_heads = T == 1 && Hkv <= QUERY_BLOCK && n >= 2 * nt;
    if (all_heads) items = n;
    int64_t *kt_at = malloc((size_t)(2 * n + 2) * sizeof(int64_t)), *v_at = kt_at + n + 1;
    if (!kt_at) return -2;
    kt_at[0] = v_at[0] = 0;    /* where each sequence's transposed keys and gathered values start */
    for (int64_t i = 0; i < n; i++) {
        int64_t L = context_lens[i] + T, ldkt = (L + KEY_BLOCK - 1) / KEY_BLOCK * KEY_BLOCK;
        kt_at[i + 1] = kt_at[i] + (gather ? Hkv * D * ldkt : 0);
        v_at[i + 1] = v_at[i] + (gather ? L * Hkv * D : 0);
    }
    float *kt = NULL, *vg = NULL;
    if (gather && (posix_memalign((void **)&kt, 64, (size_t)kt_at[n] * sizeof(float))
                   || posix_memalign((void **)&vg, 64, (size_t)v_at[n] * sizeof(float)))) {
        free(kt), free(kt_at);
        return -2;
    }
    #pragma omp parallel num_threads(nt) reduction(+ : failed)
    {
        Buffers b = {0};
        int ok = alloc_buffers(&b, H / Hkv, D);
        failed += !ok;
        if (gather) {
            #pragma omp for schedule(static)
            for (int64_t ih = 0; ih < n * Hkv; ih++) {   /* one sequence's kv head, a key block at a time */
                int64_t i = ih / Hkv, h = ih % Hkv, L = context_lens[i] + T;
                int64_t ldkt = (kt_at[i + 1] - kt_at[i]) / (Hkv * D);
                KeySource src = {.k_cache = k_cache, .v_cache = v_cache, .k_scales = k_scales,
                                 .v_scales = v_scales, .paged = tables + i * table_stride,
                                 .block_size = block_size, .kv_int8 = kv_int8};
                float *ktr = kt + kt_at[i] + h * D * ldkt, *vr = vg + v_at[i] + h * D;
                for (int64_t key0 = 0; ok && key0 < ldkt; key0 += KEY_BLOCK) {
                    int64_t nk = L - key0 < KEY_BLOCK ? L - key0 : KEY_BLOCK;
                    paged_key_block(&src, Hkv, D, h, key0, nk, b.tk, b.tv);
                    for (int64_t d = 0; d < D; d++)
                        memcpy(ktr + d * ldkt + key0, b.tk + d * KEY_BLOCK, KEY_BLOCK * sizeof(float));
                    for (int64_t j = 0; j < nk; j++)
                        memcpy(vr + (key0 + j) * Hkv * D, b.tv + j * D, D * sizeof(float));
                }
            }   /* the loop's barrier: every sequence is gathered before any item reads one */
        }
        #pragma omp for schedule(dynamic, 1) nowait
        for (int64_t it = 0; it < items; it++) {   /* the last query blocks first, as above */
            if (all_heads) {
                KeySource ks = {.k_cache = k_cache, .v_cache = v_cache, .k_scales = k_scales, .v_scales = v_scales,
                                .paged = tables + it * table_stride, .block_size = block_size, .kv_int8 = kv_int8};
                if (ok) attend_row_all_heads(q + it * H * D, &ks, out + it * H * D, H, Hkv, D, context_lens[it],
                                             scale, &b);
                continue;
            }
            int64_t i = it / (Hkv * blocks), rest = it % (Hkv * blocks);
            int64_t block = blocks - 1 - rest / Hkv, kvh = rest % Hkv;
            KeySource ks = {.kt = kt + kt_at[i], .v = vg + v_at[i], .ldkt = (kt_at[i + 1] - kt_at[i]) / (Hkv * D),
                            .k_cache = k_cache, .v_cache = v_cache, .k_scales = k_scales, .v_scales = v_scales,
                            .paged = gather ? NULL : tables + i * table_stride, .block_size = block_size,
                            .kv_int8 = kv_int8};
            if (ok)
                attend_item(q + i * T * H * D, &ks, out + i * T * H * D, T, H, Hkv, D, context_lens[i], scale,
                            kvh, block * QUERY_BLOCK, &b);
        }
        if (ok) free(b.q);
    }
    free(kt), free(vg), free(kt_at);
    return failed ? -2 : 0;
}
