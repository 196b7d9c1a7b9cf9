// The load-balanced causal split of context parallelism (parallel.cp): a
// sequence of T tokens is cut into 2·cp chunks of h = T / (2·cp); CP rank c
// holds chunks c and 2·cp − 1 − c, so every rank does the same share of the
// causal attention's work (Megatron-LM's and Llama 3's split).
//
// A rank's view of a microbatch of B sequences is [2·B, h]: rows 0..B−1 are
// chunk c of each sequence, rows B..2B−1 chunk 2·cp − 1 − c ("halves" 0 and
// 1). Every op that works row by row (norms, GEMMs, the loss) runs on the
// view unchanged; the embedding's positions and RoPE take each half's offset,
// and attention runs as ring attention over the cp group (GptStage).
#ifndef BATON_WORKER_MODEL_CONTEXT_PARALLEL_H_
#define BATON_WORKER_MODEL_CONTEXT_PARALLEL_H_

#include <cstdint>

namespace baton::model {

// The chunk CP rank `cp_rank` of `cp_size` holds as half `half` (0 or 1).
inline int64_t CpChunk(int half, int cp_rank, int cp_size) {
  return half == 0 ? cp_rank : 2 * cp_size - 1 - cp_rank;
}

// The global position of the first token of that half, for sequences of
// `seq` tokens (seq divisible by 2·cp_size).
inline int64_t CpHalfOffset(int half, int cp_rank, int cp_size, int64_t seq) {
  return CpChunk(half, cp_rank, cp_size) * (seq / (2 * cp_size));
}

// Writes rank `cp_rank`'s view [2·batch, seq / (2·cp_size)] of `whole`
// [batch, seq] into `local` (both row-major).
inline void SliceForContextParallel(const int32_t* whole, int64_t batch, int64_t seq, int cp_rank, int cp_size,
                                    int32_t* local) {
  const int64_t h = seq / (2 * cp_size);
  for (int half = 0; half < 2; ++half) {
    const int64_t begin = CpHalfOffset(half, cp_rank, cp_size, seq);
    for (int64_t b = 0; b < batch; ++b) {
      const int32_t* from = whole + b * seq + begin;
      int32_t* to = local + (half * batch + b) * h;
      for (int64_t j = 0; j < h; ++j) to[j] = from[j];
    }
  }
}

}  // namespace baton::model

#endif  // BATON_WORKER_MODEL_CONTEXT_PARALLEL_H_
