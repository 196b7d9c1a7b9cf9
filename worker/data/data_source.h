// DataSource: the training data of a job as a pure function of
// (seed, step, microbatch, dp rank) — no state, no files written, nothing
// shipped between processes. Every worker that needs a microbatch (the first
// stage for tokens, the last for targets, on every TP rank) generates the same
// bits for it, whatever the layout, and a replayed step sees the same data.
//
// With data parallelism replica r of dp runs microbatches (step, mb, r) for
// mb < M. The same global batch on one replica of M · dp microbatches is
// microbatch k = Fill(step, k % M, k / M): that is how a dp = 1 run reproduces
// a dp > 1 run (same objective when the replicas' gradients are averaged).
//
// Also SampleRng, the counter-based generator the sources draw from.
//
// Implementations are immutable after construction, so Fill is thread-safe.
#ifndef BATON_WORKER_DATA_DATA_SOURCE_H_
#define BATON_WORKER_DATA_DATA_SOURCE_H_

#include <cstdint>
#include <initializer_list>

#include "absl/status/status.h"
#include "worker/stage_model.h"

namespace baton::data {

class DataSource {
 public:
  virtual ~DataSource() = default;

  // Writes microbatch `mb` of step `step` for data-parallel replica `dp_rank`:
  // out->tokens and out->targets int32 [micro_batch_size, seq_len], targets
  // the next token of each position or -1 where it is not scored. Reuses
  // out's tensors when they already have that shape and dtype, else
  // allocates. Negative arguments are INVALID_ARGUMENT.
  virtual absl::Status Fill(int64_t step, int mb, int dp_rank, MicrobatchData* out) const = 0;

  virtual int64_t micro_batch_size() const = 0;
  virtual int64_t seq_len() const = 0;

  // The epoch (0-based) that step `step` starts in: how many times the
  // source had been read through before the step's first row (a step may
  // end in the next epoch). Sources that draw with replacement (the
  // addition task, text_file) have no epochs and say 0; -1 for a step that
  // is negative or past what the source can count.
  virtual int64_t EpochOfStep(int64_t step) const { return step < 0 ? -1 : 0; }
};

// Deterministic 64-bit draws keyed by a list of integers (SplitMix64 over a
// hash of the key): SampleRng({seed, step, mb, dp_rank, row}) gives the same
// sequence on every machine.
class SampleRng {
 public:
  explicit SampleRng(std::initializer_list<uint64_t> key);
  uint64_t Next();
  // Uniform in [0, n), n > 0 (the modulo bias is below 2^-40 for n < 2^24).
  uint64_t Below(uint64_t n) { return Next() % n; }

 private:
  uint64_t state_;
};

// Checks Fill's arguments and shapes `out` as [batch, seq] int32 tensors.
absl::Status PrepareMicrobatch(int64_t step, int mb, int dp_rank, int64_t batch, int64_t seq,
                               MicrobatchData* out);

}  // namespace baton::data

#endif  // BATON_WORKER_DATA_DATA_SOURCE_H_
