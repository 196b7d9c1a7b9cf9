#include "coordinator/memory_estimate.h"

#include <algorithm>
#include <cmath>

#include "coordinator/job_spec.h"
#include "coordinator/planner.h"
#include "gtest/gtest.h"

namespace baton {
namespace {

constexpr double kGiB = 1024.0 * 1024 * 1024;

v1::JobSpec Job(const char* text) {
  absl::StatusOr<v1::JobSpec> job = ParseJobSpec(text, "test");
  EXPECT_TRUE(job.ok()) << job.status();
  EXPECT_TRUE(ValidateJobSpec(*job).ok()) << ValidateJobSpec(*job);
  return *job;
}

// The demo's shape (examples/demo.textproto) with `model` and `schedule` swapped in.
v1::JobSpec Demo(const std::string& model = "layers: 2 d_model: 64 heads: 4 vocab: 16 seq_len: 20",
                 const std::string& schedule = "kind: \"1f1b\" microbatches: 4", int micro_batch_size = 8) {
  return Job(("name: \"demo\" model { " + model + " } parallel { pp: 2 tp: 2 } schedule { " + schedule +
              " } train { steps: 10 micro_batch_size: " + std::to_string(micro_batch_size) + " }")
                 .c_str());
}

std::vector<v1::WorkerInfo> Workers(int n, int64_t memory, const std::string& host_prefix = "h") {
  std::vector<v1::WorkerInfo> out;
  for (int i = 0; i < n; ++i) {
    v1::WorkerInfo w;
    w.set_name("w" + std::to_string(i));
    w.set_host(host_prefix + std::to_string(i));
    w.set_worker_id(i + 1);
    w.set_memory_bytes(memory);
    out.push_back(w);
  }
  return out;
}

TEST(MemoryEstimateTest, ParametersAndOptimizerStateFollowTheModelShape) {
  // GPT-2 small's blocks: 12 layers of d=768 hold 12 * (12 d^2 + 13 d) parameters.
  v1::JobSpec job = Job(R"pb(name: "g" model { layers: 12 d_model: 768 heads: 12 vocab: 50304 seq_len: 1024 }
                             schedule { kind: "gpipe" microbatches: 1 } train { steps: 1 micro_batch_size: 1 })pb");
  auto plan = MakePlan(job, Workers(1, 0), 1);
  ASSERT_TRUE(plan.ok()) << plan.status();
  WorkerMemory m = EstimateWorkerMemory(job, *plan, 0);
  const double d = 768, blocks = 12 * (12 * d * d + 13 * d), embeddings = 2 * 50304 * d + 1024 * d + 2 * d;
  EXPECT_DOUBLE_EQ(m.parameter_bytes, 4 * (blocks + embeddings));
  EXPECT_DOUBLE_EQ(m.optimizer_bytes, 3 * m.parameter_bytes);
  EXPECT_EQ(m.peak_microbatches, 1);
  // Attention scores alone are heads * seq^2 floats per block and microbatch.
  EXPECT_GT(m.activation_bytes, 12 * 12 * 1024.0 * 1024 * 4);
  // A CPU worker's in-memory snapshots: 13 shard states of values and both
  // moments (12 bytes a parameter), in its host RAM.
  EXPECT_DOUBLE_EQ(m.snapshot_bytes, 13 * 3 * m.parameter_bytes);
  EXPECT_LT(m.total() - m.snapshot_bytes, 8 * kGiB);
}

// Attention keeps P [B,H,T,T] in the GEMM inputs' precision, plus T·T floats
// of backward scratch on CPU workers (CUDA uses its stream's scratch). With
// bf16 on CUDA the estimate stays an upper bound: P's bf16 bytes, in case
// cuDNN does not load on the worker.
TEST(MemoryEstimateTest, AttentionCountsPInTheTrainingPrecisionAndScratchOnlyOffCuda) {
  auto gpt2 = [](const char* precision) {
    return Job((std::string(R"pb(name: "g" model { layers: 12 d_model: 768 heads: 12 vocab: 50304 seq_len: 1024 }
                                schedule { kind: "gpipe" microbatches: 1 }
                                train { steps: 1 micro_batch_size: 2 precision: ")pb") +
                precision + "\" }")
                   .c_str());
  };
  const v1::JobSpec fp32 = gpt2("fp32"), bf16 = gpt2("bf16");
  auto plan = MakePlan(fp32, Workers(1, 0), 1);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const double layers = 12, p_elements = 2 * 12 * 1024.0 * 1024, scratch = 1024.0 * 1024 * 4;
  const double cpu32 = EstimateWorkerMemory(fp32, *plan, 0).activation_bytes;
  const double cpu16 = EstimateWorkerMemory(bf16, *plan, 0).activation_bytes;
  EXPECT_DOUBLE_EQ(cpu32 - cpu16, layers * p_elements * 2);  // 4 -> 2 bytes per P element

  v1::Plan on_cuda = *plan;
  for (v1::RankAssignment& r : *on_cuda.mutable_ranks()) r.set_device("cuda:0");
  const double cuda16 = EstimateWorkerMemory(bf16, on_cuda, 0).activation_bytes;
  EXPECT_DOUBLE_EQ(cpu16 - cuda16, layers * scratch);
  // Still counts P (bf16) on CUDA: 24 MiB per sequence and layer.
  EXPECT_GT(cuda16, layers * p_elements * 2);
}

// On CUDA each chunk's stream keeps its op temporaries (the GEMM path's
// attention backward over one batch row, the bf16 QKV projection's fp32
// fallback, cuBLASLt's workspace), grown and never shrunk; in bf16 the GEMM
// weights also have a bf16 copy. Neither is in the CPU's estimate.
TEST(MemoryEstimateTest, CudaCountsEachChunkStreamsScratchAndBf16WeightCopies) {
  auto gpt2 = [](const char* precision, const char* schedule) {
    return Job((std::string(R"pb(name: "g" model { layers: 12 d_model: 768 heads: 12 vocab: 50304 seq_len: 1024 }
                                train { steps: 1 micro_batch_size: 2 precision: ")pb") +
                precision + "\" } " + schedule)
                   .c_str());
  };
  const char* one_chunk = "parallel { pp: 2 } schedule { kind: \"1f1b\" microbatches: 4 }";
  const char* two_chunks =
      "parallel { pp: 2 virtual_stages: 2 } schedule { kind: \"interleaved\" microbatches: 4 }";
  auto cpu_plan = MakePlan(gpt2("bf16", one_chunk), Workers(2, 0), 1);
  ASSERT_TRUE(cpu_plan.ok()) << cpu_plan.status();
  v1::Plan cuda_plan = *cpu_plan;
  for (v1::RankAssignment& r : *cuda_plan.mutable_ranks()) r.set_device("cuda:0");

  const double n = 2 * 1024, c = 768, h = 12, t = 1024;
  const double per_stream = 32.0 * (1 << 20) + 16 * n + (1 << 20) + 6 * h * t * t + 4 * n * 3 * c;
  EXPECT_EQ(EstimateWorkerMemory(gpt2("bf16", one_chunk), *cpu_plan, 0).scratch_bytes, 0);
  EXPECT_DOUBLE_EQ(EstimateWorkerMemory(gpt2("bf16", one_chunk), cuda_plan, 0).scratch_bytes, per_stream);
  auto interleaved = MakePlan(gpt2("bf16", two_chunks), Workers(2, 0), 1);
  ASSERT_TRUE(interleaved.ok()) << interleaved.status();
  v1::Plan cuda_interleaved = *interleaved;
  for (v1::RankAssignment& r : *cuda_interleaved.mutable_ranks()) r.set_device("cuda:0");
  EXPECT_DOUBLE_EQ(EstimateWorkerMemory(gpt2("bf16", two_chunks), cuda_interleaved, 0).scratch_bytes, 2 * per_stream);
  // fp32 on CUDA: the attention backward's floats and cuBLASLt's workspace only.
  EXPECT_DOUBLE_EQ(EstimateWorkerMemory(gpt2("fp32", one_chunk), cuda_plan, 0).scratch_bytes,
                   32.0 * (1 << 20) + 16 * n + (1 << 20) + 4 * h * t * t);

  // bf16's copy of the GEMM weights: 12 d^2 per layer of the stage, and the
  // tied head's vocab x d on the last stage.
  for (int stage = 0; stage < 2; ++stage) {
    const double copies = cpu_plan->stages(stage).num_layers() * 12 * c * c + (stage == 1 ? 50304 * c : 0);
    EXPECT_DOUBLE_EQ(EstimateWorkerMemory(gpt2("bf16", one_chunk), *cpu_plan, stage).parameter_bytes -
                         EstimateWorkerMemory(gpt2("fp32", one_chunk), *cpu_plan, stage).parameter_bytes,
                     2 * copies)
        << stage;
  }
}

// A long-sequence bf16 job (T 4096, 32 heads of 64: P is 1 GiB per block and
// microbatch) on GPUs whose workers registered fused attention: the estimate
// counts cuDNN's softmax stats and o's copy instead of P, plus its backward
// workspace once, and the job fits where it was refused before.
v1::JobSpec LongBf16(const std::string& precision = "bf16", int heads = 32) {
  return Job(("name: \"long\" model { layers: 8 d_model: 2048 heads: " + std::to_string(heads) +
              " vocab: 256 seq_len: 4096 } parallel { pp: 2 } schedule { kind: \"gpipe\" microbatches: 4 }"
              " train { steps: 1 micro_batch_size: 1 precision: \"" + precision + "\" }")
                 .c_str());
}

std::vector<v1::WorkerInfo> Gpus(int n, int64_t memory, bool fused) {
  std::vector<v1::WorkerInfo> gpus = Workers(n, memory);
  for (int i = 0; i < n; ++i) {
    gpus[i].set_device("cuda:0");
    gpus[i].set_device_uuid("GPU-" + std::to_string(i));
    gpus[i].set_fused_attention_bf16(fused);
  }
  return gpus;
}

TEST(MemoryEstimateTest, FusedAttentionCountsStatsAndOutputInsteadOfP) {
  const v1::JobSpec job = LongBf16();
  const int64_t gpu = int64_t{24} << 30;
  auto without = MakePlan(job, Gpus(2, gpu, false), 1);
  ASSERT_FALSE(without.ok());  // P: 4 layers x 4 microbatches x 1 GiB on each stage
  EXPECT_EQ(without.status().code(), absl::StatusCode::kResourceExhausted) << without.status();
  auto with = MakePlan(job, Gpus(2, gpu, true), 1);
  ASSERT_TRUE(with.ok()) << with.status();
  for (const v1::RankAssignment& r : with->ranks()) EXPECT_TRUE(r.fused_attention_bf16());

  // Per block and microbatch: P (B·H·T·T bf16) gives way to the stats
  // (B·H·T floats, a multiple of 256 here) and o (B·T·C bf16); the stream's
  // scratch holds cuDNN's workspace (B·H·T·T bf16, T a multiple of 64)
  // instead of the GEMM path's H·T·T floats and bf16 (one batch row).
  const double b = 1, h = 32, t = 4096, c = 2048, layers = 4, peak = 4;
  const double p = 2 * b * h * t * t, saved = 4 * b * h * t + 2 * b * t * c, workspace = 2 * b * h * t * t;
  auto p_plan = MakePlan(job, Gpus(2, 0, false), 1);
  ASSERT_TRUE(p_plan.ok()) << p_plan.status();
  for (int stage = 0; stage < 2; ++stage) {
    const WorkerMemory keeps_p = EstimateWorkerMemory(job, *p_plan, stage);
    const WorkerMemory fused = EstimateWorkerMemory(job, *with, stage);
    EXPECT_DOUBLE_EQ(keeps_p.activation_bytes - fused.activation_bytes, layers * peak * (p - saved));
    EXPECT_DOUBLE_EQ(keeps_p.scratch_bytes - fused.scratch_bytes, 6 * h * t * t - workspace);
    EXPECT_LT(fused.total(), static_cast<double>(gpu)) << stage;
    EXPECT_GT(keeps_p.total(), static_cast<double>(gpu)) << stage;
  }
}

TEST(MemoryEstimateTest, FusedAttentionOnlyWhereEveryRankHasItAndTheBackendTakesIt) {
  const v1::JobSpec job = LongBf16();
  auto p_plan = MakePlan(job, Gpus(2, 0, false), 1);
  auto fused_plan = MakePlan(job, Gpus(2, 0, true), 1);
  ASSERT_TRUE(p_plan.ok() && fused_plan.ok());
  const double keeps_p = EstimateWorkerMemory(job, *p_plan, 0).activation_bytes;
  const double fused = EstimateWorkerMemory(job, *fused_plan, 0).activation_bytes;
  ASSERT_LT(fused, keeps_p);

  // One rank of the stage lacks it (dp 2: two workers per stage), whichever: P.
  v1::JobSpec dp2 = job;
  dp2.mutable_parallel()->set_dp(2);
  auto dp2_fused = MakePlan(dp2, Gpus(4, 0, true), 1);
  auto dp2_p = MakePlan(dp2, Gpus(4, 0, false), 1);
  ASSERT_TRUE(dp2_fused.ok() && dp2_p.ok());
  const double all_fused = EstimateWorkerMemory(dp2, *dp2_fused, 0).activation_bytes;
  const double stage1_fused = EstimateWorkerMemory(dp2, *dp2_fused, 1).activation_bytes;
  const double all_p = EstimateWorkerMemory(dp2, *dp2_p, 0).activation_bytes;
  ASSERT_LT(all_fused, all_p);
  for (int lacking = 0; lacking < 2; ++lacking) {
    v1::Plan mixed = *dp2_fused;
    for (v1::RankAssignment& r : *mixed.mutable_ranks()) {
      if (r.pp_rank() == 0 && r.dp_rank() == lacking) r.set_fused_attention_bf16(false);
    }
    EXPECT_DOUBLE_EQ(EstimateWorkerMemory(dp2, mixed, 0).activation_bytes, all_p) << lacking;
    EXPECT_DOUBLE_EQ(EstimateWorkerMemory(dp2, mixed, 1).activation_bytes, stage1_fused) << lacking;
  }

  // fp32 never takes it: P in floats, as without the flag.
  const v1::JobSpec fp32 = LongBf16("fp32");
  EXPECT_DOUBLE_EQ(EstimateWorkerMemory(fp32, *fused_plan, 0).activation_bytes,
                   EstimateWorkerMemory(fp32, *p_plan, 0).activation_bytes);
  // Heads of 256 (8 heads over 2048): Ampere's cuDNN has no fused backward
  // for them, so P; heads of 128 (16) take it.
  const v1::JobSpec wide = LongBf16("bf16", 8), hd128 = LongBf16("bf16", 16);
  EXPECT_DOUBLE_EQ(EstimateWorkerMemory(wide, *fused_plan, 0).activation_bytes,
                   EstimateWorkerMemory(wide, *p_plan, 0).activation_bytes);
  EXPECT_LT(EstimateWorkerMemory(hd128, *fused_plan, 0).activation_bytes,
            EstimateWorkerMemory(hd128, *p_plan, 0).activation_bytes);
  // A CPU rank never has it (the registry refuses the flag there): P and scratch.
  v1::Plan on_cpu = *fused_plan;
  for (v1::RankAssignment& r : *on_cpu.mutable_ranks()) r.set_device("cpu");
  EXPECT_GT(EstimateWorkerMemory(job, on_cpu, 0).activation_bytes, keeps_p);
}

TEST(MemoryEstimateTest, PeakMicrobatchesFollowTheSchedule) {
  v1::JobSpec gpipe = Demo("layers: 2 d_model: 64 heads: 4 vocab: 16 seq_len: 20", "kind: \"gpipe\" microbatches: 8");
  v1::JobSpec one_f_one_b = Demo("layers: 2 d_model: 64 heads: 4 vocab: 16 seq_len: 20", "kind: \"1f1b\" microbatches: 8");
  auto plan = MakePlan(gpipe, Workers(4, 0), 1);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(EstimateWorkerMemory(gpipe, *plan, 0).peak_microbatches, 8);
  EXPECT_EQ(EstimateWorkerMemory(one_f_one_b, *plan, 0).peak_microbatches, 2);  // p - rank
  EXPECT_EQ(EstimateWorkerMemory(one_f_one_b, *plan, 1).peak_microbatches, 1);
  EXPECT_GT(EstimateWorkerMemory(gpipe, *plan, 0).activation_bytes,
            3 * EstimateWorkerMemory(one_f_one_b, *plan, 0).activation_bytes);
}

TEST(MemoryEstimateTest, TheDemoFitsInAGigabyte) {
  v1::JobSpec job = Demo();
  auto plan = MakePlan(job, Workers(4, int64_t{1} << 30), 1);
  EXPECT_TRUE(plan.ok()) << plan.status();
}

TEST(MemoryEstimateTest, AJobTooLargeForTheWorkersIsRefusedNamingStageWorkerAndNumbers) {
  // d_model 16384 with 32 layers: ~100 GiB of parameters and AdamW state per stage.
  v1::JobSpec job = Demo("layers: 32 d_model: 16384 heads: 128 vocab: 256 seq_len: 64", "kind: \"1f1b\" microbatches: 4", 1);
  auto plan = MakePlan(job, Workers(4, int64_t{24} << 30), 1);
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kResourceExhausted);
  const std::string message(plan.status().message());
  EXPECT_NE(message.find("pipeline stage 0"), std::string::npos) << message;
  EXPECT_NE(message.find("worker 'w0' has 24.0 GiB"), std::string::npos) << message;
  EXPECT_NE(message.find("parameters "), std::string::npos) << message;
  EXPECT_NE(message.find("raise parallel.pp"), std::string::npos) << message;
}

TEST(MemoryEstimateTest, ActivationsOfLongSequencesAreRefusedToo) {
  // 16 microbatches of 64 x 2048 tokens under gpipe: attention scores alone
  // are 16 * 64 * 2 * 2048^2 floats (32 GiB) per block.
  v1::JobSpec job = Demo("layers: 4 d_model: 256 heads: 4 vocab: 256 seq_len: 2048", "kind: \"gpipe\" microbatches: 16", 64);
  auto plan = MakePlan(job, Workers(4, int64_t{64} << 30), 1);
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(plan.status().message().find("activations of 16 microbatch-chunks"), std::string::npos)
      << plan.status();
}

TEST(MemoryEstimateTest, WorkersSharingAHostMustFitTogether) {
  // Each worker alone fits in the host's 1 GiB, four of them do not.
  v1::JobSpec job = Demo("layers: 2 d_model: 1024 heads: 4 vocab: 256 seq_len: 128", "kind: \"1f1b\" microbatches: 4", 4);
  auto plan = MakePlan(job, Workers(4, 0), 1);
  ASSERT_TRUE(plan.ok());
  const double one = EstimateWorkerMemory(job, *plan, 0).total();
  const int64_t host_memory = static_cast<int64_t>(one * 2);
  std::vector<v1::WorkerInfo> shared = Workers(4, host_memory);
  for (auto& w : shared) w.set_host("box");
  auto refused = MakePlan(job, shared, 1);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(refused.status().message().find("4 workers the plan puts on host 'box'"), std::string::npos)
      << refused.status();
  EXPECT_TRUE(MakePlan(job, Workers(4, host_memory), 1).ok());  // one per host
}

// A GPU worker registers its GPU's memory: four workers on four GPUs of one
// host each have their own, while workers that see one GPU (by UUID, however
// they name it) share it.
TEST(MemoryEstimateTest, GpuWorkersShareOnlyTheGpuTheyRunOn) {
  v1::JobSpec job = Demo("layers: 2 d_model: 1024 heads: 4 vocab: 256 seq_len: 128", "kind: \"1f1b\" microbatches: 4", 4);
  std::vector<v1::WorkerInfo> gpus = Workers(4, 0);
  for (int i = 0; i < 4; ++i) {
    gpus[i].set_host("box");
    gpus[i].set_device("cuda:" + std::to_string(i));
    gpus[i].set_device_uuid("GPU-" + std::to_string(i));
  }
  auto plan = MakePlan(job, gpus, 1);  // memory 0: not checked
  ASSERT_TRUE(plan.ok());
  // Room for one worker of either stage, not for two.
  const double e0 = EstimateWorkerMemory(job, *plan, 0).total(), e1 = EstimateWorkerMemory(job, *plan, 1).total();
  const int64_t gpu_memory = static_cast<int64_t>(std::max(e0, e1) * 1.05);
  ASSERT_LT(gpu_memory, 2 * std::min(e0, e1));
  for (auto& w : gpus) w.set_memory_bytes(gpu_memory);
  EXPECT_TRUE(MakePlan(job, gpus, 1).ok()) << MakePlan(job, gpus, 1).status();  // one GPU each

  for (auto& w : gpus) w.clear_device_uuid();  // no UUIDs: host and cuda:N tell them apart
  EXPECT_TRUE(MakePlan(job, gpus, 1).ok()) << MakePlan(job, gpus, 1).status();

  // Two containers on one node name one GPU cuda:0 each (and cuda:1 twice).
  for (int i = 0; i < 4; ++i) {
    gpus[i].set_host("pod-" + std::to_string(i));
    gpus[i].set_device("cuda:0");
    gpus[i].set_device_uuid(i < 2 ? "GPU-a" : "GPU-b");
  }
  auto refused = MakePlan(job, gpus, 1);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(refused.status().message().find("2 workers the plan puts on GPU GPU-a"), std::string::npos)
      << refused.status();
  EXPECT_NE(refused.status().message().find("more GPUs"), std::string::npos) << refused.status();
}

TEST(MemoryEstimateTest, WorkersThatReportNoMemoryAreNotChecked) {
  v1::JobSpec job = Demo("layers: 32 d_model: 16384 heads: 128 vocab: 256 seq_len: 64", "kind: \"1f1b\" microbatches: 4", 1);
  EXPECT_TRUE(MakePlan(job, Workers(4, 0), 1).ok());
}

TEST(MemoryEstimateTest, SyntheticActivationsCountPerStoredMicrobatch) {
  v1::JobSpec job = Job(R"pb(name: "s" model { layers: 2 synthetic { forward_ms: 1 activation_bytes: 1048576 } }
                             parallel { pp: 2 } schedule { kind: "gpipe" microbatches: 8 }
                             train { steps: 1 micro_batch_size: 1 })pb");
  auto plan = MakePlan(job, Workers(2, 0), 1);
  ASSERT_TRUE(plan.ok()) << plan.status();
  WorkerMemory m = EstimateWorkerMemory(job, *plan, 0);
  EXPECT_EQ(m.peak_microbatches, 8);
  EXPECT_DOUBLE_EQ(m.activation_bytes, 2.0 * 8 * 1048576);
}

TEST(MemoryEstimateTest, FormatBytesIsReadable) {
  EXPECT_EQ(FormatBytes(512), "512 B");
  EXPECT_EQ(FormatBytes(1536), "1.5 KiB");
  EXPECT_EQ(FormatBytes(24.0 * kGiB), "24.0 GiB");
}

}  // namespace
}  // namespace baton

namespace baton {
namespace {

// A V puts the first and the last chunk on pipeline rank 0: its estimate
// holds the embeddings and the head (two copies of the tied wte), the middle
// rank neither; the plan carries the placement.
TEST(MemoryEstimateTest, AVPlacementPutsBothEndsOnRankZero) {
  const std::string model = "layers: 4 d_model: 64 heads: 4 vocab: 4096 seq_len: 20";
  v1::JobSpec v = Job(("name: \"v\" model { " + model +
                       " } parallel { pp: 2 virtual_stages: 2 } schedule { kind: \"zb-v\" microbatches: 4 } "
                       "train { steps: 10 micro_batch_size: 8 }")
                          .c_str());
  v1::JobSpec looped = v;
  looped.mutable_schedule()->set_kind("interleaved");
  auto vplan = MakePlan(v, Workers(2, 0), 1);
  auto lplan = MakePlan(looped, Workers(2, 0), 1);
  ASSERT_TRUE(vplan.ok()) << vplan.status();
  ASSERT_TRUE(lplan.ok()) << lplan.status();
  EXPECT_EQ(std::vector<int>(vplan->stage_ranks().begin(), vplan->stage_ranks().end()),
            (std::vector<int>{0, 1, 1, 0}));
  EXPECT_TRUE(lplan->stage_ranks().empty());
  const double wte = 4 * 4096.0 * 64;  // one copy of the tied embedding, fp32
  const WorkerMemory v_rank0 = EstimateWorkerMemory(v, *vplan, 0), v_rank1 = EstimateWorkerMemory(v, *vplan, 1);
  const WorkerMemory looped0 = EstimateWorkerMemory(looped, *lplan, 0),
                     looped1 = EstimateWorkerMemory(looped, *lplan, 1);
  // Looped: rank 0 has the embeddings, rank 1 the head; the V: rank 0 both.
  EXPECT_GT(v_rank0.parameter_bytes - looped0.parameter_bytes, 0.9 * wte);
  EXPECT_GT(looped1.parameter_bytes - v_rank1.parameter_bytes, 0.9 * wte);
  EXPECT_DOUBLE_EQ(v_rank0.parameter_bytes + v_rank1.parameter_bytes,
                   looped0.parameter_bytes + looped1.parameter_bytes);
  EXPECT_EQ(v_rank0.peak_microbatches, 4);  // zb-v: min(2p, v*m) chunk-activations
}

}  // namespace
}  // namespace baton

namespace baton {
namespace {

// A small Llama on one worker: 2 layers, C = 16, H = 4 (hd 4), KV = 2, F = 24,
// V = 16, T = 8, one sequence per microbatch.
v1::JobSpec SmallLlama(const std::string& extra) {
  return Job((R"pb(name: "l" model { arch: "llama" layers: 2 d_model: 16 heads: 4 vocab: 16 seq_len: 8 ffn_dim: 24 )pb" +
              extra + R"pb( } schedule { kind: "gpipe" microbatches: 1 } train { steps: 1 micro_batch_size: 1 })pb")
                 .c_str());
}

TEST(MemoryEstimateTest, LlamaCountsItsOwnParametersAndActivations) {
  const v1::JobSpec untied = SmallLlama("kv_heads: 2");
  auto plan = MakePlan(untied, Workers(1, 0), 1);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const WorkerMemory m = EstimateWorkerMemory(untied, *plan, 0);
  // Per block: two RMSNorm weights 2·16 = 32, q and o 2·16·16 = 512, k and v
  // 2·(2·4)·16 = 256, gate, up, down 3·24·16 = 1152: 1952. Two blocks 3904,
  // embed_tokens 16·16 = 256 (no position embedding), norm 16, lm_head 256:
  // 4432 floats. No biases anywhere.
  EXPECT_DOUBLE_EQ(m.parameter_bytes, 4 * 4432.0);
  EXPECT_DOUBLE_EQ(m.optimizer_bytes, 3 * 4 * 4432.0);
  // Per block, N = 8 tokens, C' = 16, KV' = 8, F' = 24:
  //   forward  4·(6·8·16 + 2·8 + 8·(5·16 + 2·8) + 3·8·24) = 8512
  //   backward 4·(3·8·16 + 3·8·24 + 8·(5·16 + 2·8))       = 6912
  //   P 4·(1·4·8·8) = 1024, CPU backward scratch 4·8·8 = 256
  // = 16704, two blocks 33408; the first stage's tokens, x0 and its gradient
  // 4·(2·8·16 + 8) = 1056; the head's 4·(3·8·16 + 8·16 + 8·8) = 2304.
  EXPECT_EQ(m.peak_microbatches, 1);
  EXPECT_DOUBLE_EQ(m.activation_bytes, 33408.0 + 1056 + 2304);

  // A tied head on the one stage that also holds the embedding adds no copy.
  const v1::JobSpec tied = SmallLlama("kv_heads: 2 tie_embeddings: true");
  EXPECT_DOUBLE_EQ(EstimateWorkerMemory(tied, *plan, 0).parameter_bytes, 4 * (4432.0 - 256));
  EXPECT_DOUBLE_EQ(EstimateWorkerMemory(tied, *plan, 0).activation_bytes, m.activation_bytes);
}

TEST(MemoryEstimateTest, GroupedQueryAttentionShrinksTheEstimate) {
  const v1::JobSpec mha = SmallLlama("kv_heads: 4"), gqa = SmallLlama("kv_heads: 2"), mqa = SmallLlama("kv_heads: 1");
  auto plan = MakePlan(mha, Workers(1, 0), 1);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const WorkerMemory a = EstimateWorkerMemory(mha, *plan, 0), b = EstimateWorkerMemory(gqa, *plan, 0),
                     c = EstimateWorkerMemory(mqa, *plan, 0);
  // k and v lose (4 - 2)·4 rows of 16 each per block: 2 blocks · 2 · 8 · 16 floats.
  EXPECT_DOUBLE_EQ(a.parameter_bytes - b.parameter_bytes, 4 * 2 * 2 * 8 * 16.0);
  // k, v, dk and dv lose 8 channels each per token: 2 blocks · 4 · 8 tokens · 8.
  EXPECT_DOUBLE_EQ(a.activation_bytes - b.activation_bytes, 4 * 2 * 4 * 8 * 8.0);
  EXPECT_GT(b.total(), c.total());
  EXPECT_GT(b.optimizer_bytes, c.optimizer_bytes);
  // Unset kv_heads is multi-head attention.
  EXPECT_DOUBLE_EQ(EstimateWorkerMemory(SmallLlama(""), *plan, 0).total(), a.total());
}

TEST(MemoryEstimateTest, LlamaStagesSplitOverPipelineAndTensorRanks) {
  const v1::JobSpec job = Job(R"pb(name: "l"
      model { arch: "llama" layers: 2 d_model: 16 heads: 4 kv_heads: 2 vocab: 16 seq_len: 8 ffn_dim: 24 }
      parallel { pp: 2 tp: 2 } schedule { kind: "gpipe" microbatches: 1 } train { steps: 1 micro_batch_size: 1 })pb");
  auto plan = MakePlan(job, Workers(4, 0), 1);
  ASSERT_TRUE(plan.ok()) << plan.status();
  // One block per stage: its matrices split over tp 2 (1920 / 2 = 960) and
  // its norms replicated (32): 992; stage 0 the whole embedding (256), stage 1
  // the final norm (16) and the untied lm_head (256).
  EXPECT_DOUBLE_EQ(EstimateWorkerMemory(job, *plan, 0).parameter_bytes, 4 * (992.0 + 256));
  EXPECT_DOUBLE_EQ(EstimateWorkerMemory(job, *plan, 1).parameter_bytes, 4 * (992.0 + 16 + 256));
}

// ZeRO stage 1: one DP rank's shard of a chunk's N parameters, as the worker
// cuts it: round_up(ceil(N / dp), 16).
double Shard(int64_t n, int64_t dp) { return static_cast<double>(((n + dp - 1) / dp + 15) / 16 * 16); }

// With parallel.zero_stage 1 each DP rank keeps AdamW's m and v for its shard
// only; its gradients, parameters, activations and buffers are the same.
// Sequence parallelism keeps 1/tp of the residual stream per block: the
// estimate falls (GPT-2 and Llama), the rest of it does not move, and a job
// whose activations fit only with it is told to set it.
TEST(MemoryEstimateTest, SequenceParallelShrinksTheActivationsAndIsSuggested) {
  for (const std::string& model : {std::string("layers: 4 d_model: 256 heads: 4 vocab: 256 seq_len: 256"),
                                  std::string("arch: \"llama\" layers: 4 d_model: 256 heads: 4 kv_heads: 2 "
                                              "vocab: 256 seq_len: 256 ffn_dim: 512")}) {
    SCOPED_TRACE(model);
    const v1::JobSpec tp = Demo(model, "kind: \"1f1b\" microbatches: 4", 8);
    v1::JobSpec sp = tp;
    sp.mutable_parallel()->set_sequence_parallel(true);
    ASSERT_TRUE(ValidateJobSpec(sp).ok()) << ValidateJobSpec(sp);
    auto plan = MakePlan(tp, Workers(4, 0), 1);
    ASSERT_TRUE(plan.ok()) << plan.status();
    const WorkerMemory a = EstimateWorkerMemory(tp, *plan, 0), b = EstimateWorkerMemory(sp, *plan, 0);
    EXPECT_LT(b.activation_bytes, 0.9 * a.activation_bytes);
    EXPECT_DOUBLE_EQ(a.parameter_bytes, b.parameter_bytes);
    EXPECT_DOUBLE_EQ(a.optimizer_bytes, b.optimizer_bytes);

    // Workers with room for the SP job but not the TP one.
    const int64_t between = static_cast<int64_t>((a.total() + b.total()) / 2);
    auto refused = MakePlan(tp, Workers(4, between), 1);
    ASSERT_FALSE(refused.ok());
    EXPECT_NE(refused.status().message().find("set parallel.sequence_parallel: true"), std::string::npos)
        << refused.status();
    EXPECT_TRUE(MakePlan(sp, Workers(4, between), 1).ok());
  }
}

TEST(MemoryEstimateTest, ZeroStageOneShardsTheAdamWMomentsOverTheDataParallelRanks) {
  // GPT-2 of d 36 (heads of 9) so that the shard needs padding: 2 blocks of
  // 12 d^2 + 13 d, wte 17 x d and its tied copy, wpe 20 x d, the final norm.
  const std::string text = R"pb(name: "z" model { layers: 2 d_model: 36 heads: 4 vocab: 17 seq_len: 20 }
                                schedule { kind: "gpipe" microbatches: 1 } train { steps: 1 micro_batch_size: 1 }
                                parallel { dp: 2 )pb";
  const v1::JobSpec whole = Job((text + "}").c_str());
  const v1::JobSpec sharded = Job((text + "zero_stage: 1 }").c_str());
  auto plan = MakePlan(whole, Workers(2, 0), 1);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const int64_t d = 36, n = 2 * (12 * d * d + 13 * d) + 2 * 17 * d + 20 * d + 2 * d;  // 34056
  ASSERT_EQ(Shard(n, 2), 17040) << "ceil(34056 / 2) = 17028, padded to 16";
  const WorkerMemory a = EstimateWorkerMemory(whole, *plan, 0), b = EstimateWorkerMemory(sharded, *plan, 0);
  EXPECT_DOUBLE_EQ(a.optimizer_bytes, 3 * 4.0 * n);
  EXPECT_DOUBLE_EQ(b.optimizer_bytes, 4.0 * n + 2 * 4 * Shard(n, 2));
  EXPECT_DOUBLE_EQ(a.optimizer_bytes - b.optimizer_bytes, 2 * 4 * (n - Shard(n, 2)));
  EXPECT_DOUBLE_EQ(a.parameter_bytes, b.parameter_bytes);
  EXPECT_DOUBLE_EQ(a.activation_bytes, b.activation_bytes);
  EXPECT_DOUBLE_EQ(a.comm_bytes, b.comm_bytes);
  // The snapshots hold the moments as the worker does: sharded too.
  EXPECT_DOUBLE_EQ(a.snapshot_bytes - b.snapshot_bytes, 13 * (a.optimizer_bytes - b.optimizer_bytes));
  EXPECT_DOUBLE_EQ(a.total() - b.total(), 14 * (a.optimizer_bytes - b.optimizer_bytes));

  // Per stage, each with its own count on its TP rank: the Llama stages of
  // LlamaStagesSplitOverPipelineAndTensorRanks hold 1248 and 1264.
  const v1::JobSpec llama = Job(R"pb(name: "l"
      model { arch: "llama" layers: 2 d_model: 16 heads: 4 kv_heads: 2 vocab: 16 seq_len: 8 ffn_dim: 24 }
      parallel { pp: 2 tp: 2 dp: 2 zero_stage: 1 } schedule { kind: "gpipe" microbatches: 1 }
      train { steps: 1 micro_batch_size: 1 })pb");
  auto llama_plan = MakePlan(llama, Workers(8, 0), 1);
  ASSERT_TRUE(llama_plan.ok()) << llama_plan.status();
  EXPECT_DOUBLE_EQ(EstimateWorkerMemory(llama, *llama_plan, 0).optimizer_bytes, 4 * 1248.0 + 8 * Shard(1248, 2));
  EXPECT_DOUBLE_EQ(EstimateWorkerMemory(llama, *llama_plan, 1).optimizer_bytes, 4 * 1264.0 + 8 * Shard(1264, 2));
  EXPECT_EQ(Shard(1264, 2), 640) << "632 padded to 16";
}

// In-memory recovery snapshots live in the worker's host RAM: a CPU job
// that fits without them but not with them is refused with
// fault_tolerance.snapshot_every_steps: 0 among the fixes, and accepted with
// it; where every rank of a stage is on CUDA they are not counted against
// the GPU's memory.
TEST(MemoryEstimateTest, InMemorySnapshotsCountInHostRamAndCanBeTurnedOff) {
  const std::string text = R"pb(name: "s" model { layers: 4 d_model: 256 heads: 4 vocab: 16 seq_len: 16 }
                                schedule { kind: "1f1b" microbatches: 2 } train { steps: 1 micro_batch_size: 1 }
                                parallel { dp: 2 } )pb";
  const v1::JobSpec on = Job(text.c_str());
  const v1::JobSpec off = Job((text + "fault_tolerance { snapshot_every_steps: 0 }").c_str());
  auto plan = MakePlan(on, Workers(2, 0), 1);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const WorkerMemory with = EstimateWorkerMemory(on, *plan, 0), without = EstimateWorkerMemory(off, *plan, 0);
  const double state = 3 * with.parameter_bytes;  // values and both moments
  EXPECT_DOUBLE_EQ(with.snapshot_bytes, 13 * state);
  EXPECT_DOUBLE_EQ(without.snapshot_bytes, state) << "one kept after a resume from a checkpoint";
  const int64_t memory = static_cast<int64_t>((with.total() + without.total()) / 2);
  auto refused = MakePlan(on, Workers(2, memory), 1);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  const std::string message(refused.status().message());
  EXPECT_NE(message.find("in-memory snapshots " + FormatBytes(with.snapshot_bytes)), std::string::npos) << message;
  EXPECT_NE(message.find("set fault_tolerance.snapshot_every_steps: 0 to keep no in-memory recovery snapshots in "
                         "host RAM (up to " +
                         FormatBytes(with.snapshot_bytes - without.snapshot_bytes) + " less per worker"),
            std::string::npos)
      << message;
  EXPECT_TRUE(MakePlan(off, Workers(2, memory), 1).ok()) << MakePlan(off, Workers(2, memory), 1).status();

  v1::Plan on_cuda = *plan;
  for (v1::RankAssignment& r : *on_cuda.mutable_ranks()) r.set_device("cuda:0");
  EXPECT_EQ(EstimateWorkerMemory(on, on_cuda, 0).snapshot_bytes, 0);
}

// A job whose DP replicas do not fit with whole AdamW state is refused with
// parallel.zero_stage: 1 as the first fix (the others kept), and the same job
// with it is accepted; at dp 1 there is nothing to shard, so no such advice.
TEST(MemoryEstimateTest, AJobThatFitsOnlyShardedIsToldToSetZeroStageOne) {
  const std::string text = R"pb(name: "z" model { layers: 8 d_model: 1024 heads: 8 vocab: 256 seq_len: 64 }
                                schedule { kind: "gpipe" microbatches: 1 } train { steps: 1 micro_batch_size: 1 }
                                parallel { dp: 2 )pb";
  const v1::JobSpec whole = Job((text + "}").c_str());
  const v1::JobSpec sharded = Job((text + "zero_stage: 1 }").c_str());
  auto plan = MakePlan(whole, Workers(2, 0), 1);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const double need_whole = EstimateWorkerMemory(whole, *plan, 0).total();
  const double need_sharded = EstimateWorkerMemory(sharded, *plan, 0).total();
  ASSERT_LT(need_sharded, need_whole);
  const int64_t memory = static_cast<int64_t>((need_whole + need_sharded) / 2);

  auto refused = MakePlan(whole, Workers(2, memory), 1);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  const std::string message(refused.status().message());
  EXPECT_NE(message.find("set parallel.zero_stage: 1 to shard the AdamW moments over the 2 data-parallel ranks (up to " +
                         FormatBytes(EstimateWorkerMemory(whole, *plan, 0).optimizer_bytes -
                                     EstimateWorkerMemory(sharded, *plan, 0).optimizer_bytes) +
                         " less per worker)"),
            std::string::npos)
      << message;
  EXPECT_NE(message.find("raise parallel.pp or parallel.tp"), std::string::npos) << message;

  auto accepted = MakePlan(sharded, Workers(2, memory), 1);
  EXPECT_TRUE(accepted.ok()) << accepted.status();

  // Two workers sharing one host: the same advice (two whole ones need more
  // than it has, two sharded ones less).
  std::vector<v1::WorkerInfo> shared = Workers(2, static_cast<int64_t>(need_whole + need_sharded));
  for (auto& w : shared) w.set_host("box");
  auto together = MakePlan(whole, shared, 1);
  ASSERT_FALSE(together.ok());
  EXPECT_NE(together.status().message().find("set parallel.zero_stage: 1"), std::string::npos) << together.status();
  EXPECT_TRUE(MakePlan(sharded, shared, 1).ok()) << MakePlan(sharded, shared, 1).status();

  const v1::JobSpec single = Job(R"pb(name: "z" model { layers: 8 d_model: 1024 heads: 8 vocab: 256 seq_len: 64 }
                                      schedule { kind: "gpipe" microbatches: 1 }
                                      train { steps: 1 micro_batch_size: 1 })pb");
  auto alone = MakePlan(single, Workers(1, memory / 2), 1);
  ASSERT_FALSE(alone.ok());
  EXPECT_EQ(alone.status().message().find("zero_stage"), std::string::npos) << alone.status();
  EXPECT_NE(alone.status().message().find("raise parallel.pp"), std::string::npos) << alone.status();
}

// A long-sequence job (seq_len 2048) without cp, planned on one worker, and
// with cp 2 on two; `text` opens its parallel { } for more fields.
struct LongSequenceJobs {
  std::string text = R"pb(name: "c" model { layers: 2 d_model: 64 heads: 4 vocab: 64 seq_len: 2048 }
                          schedule { kind: "gpipe" microbatches: 2 } train { steps: 1 micro_batch_size: 1 }
                          parallel { )pb";
  v1::JobSpec one = Job((text + "}").c_str());
  v1::JobSpec two = Job((text + "cp: 2 }").c_str());
  absl::StatusOr<v1::Plan> plan = MakePlan(one, Workers(1, 0), 1);
  absl::StatusOr<v1::Plan> cp_plan = MakePlan(two, Workers(2, 0), 1);
};

// Context parallelism: each rank holds seq_len / cp tokens of every
// sequence, so the activations fall by cp (the estimate divides the whole
// term); the CP ranks reduce the gradients with the DP ranks, so a job of
// dp 1 gains the group's gradient buffer, and ZeRO 1 shards over dp*cp.
TEST(MemoryEstimateTest, ContextParallelismDividesTheActivationsByCp) {
  const LongSequenceJobs jobs;
  const std::string& text = jobs.text;
  const v1::JobSpec& one = jobs.one;
  const v1::JobSpec& two = jobs.two;
  const absl::StatusOr<v1::Plan>& plan = jobs.plan;
  const absl::StatusOr<v1::Plan>& cp_plan = jobs.cp_plan;
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_TRUE(cp_plan.ok()) << cp_plan.status();
  const WorkerMemory a = EstimateWorkerMemory(one, *plan, 0), b = EstimateWorkerMemory(two, *cp_plan, 0);
  EXPECT_DOUBLE_EQ(b.activation_bytes, a.activation_bytes / 2);
  EXPECT_DOUBLE_EQ(b.parameter_bytes, a.parameter_bytes);
  EXPECT_DOUBLE_EQ(b.optimizer_bytes, a.optimizer_bytes);
  EXPECT_DOUBLE_EQ(b.comm_bytes, a.comm_bytes + a.parameter_bytes) << "the dp*cp group's gradient buffer";
  EXPECT_EQ(b.peak_microbatches, a.peak_microbatches);
  // ZeRO 1 at dp 1 shards over the two CP ranks.
  const v1::JobSpec sharded = Job((text + "cp: 2 zero_stage: 1 }").c_str());
  const int64_t n = static_cast<int64_t>(b.parameter_bytes / 4);
  EXPECT_DOUBLE_EQ(EstimateWorkerMemory(sharded, *cp_plan, 0).optimizer_bytes, 4.0 * n + 2 * 4 * Shard(n, 2))
      << "the gradients stay whole, the two moments hold half each";
}

// A sequence too long for one worker's memory: refused naming parallel.cp
// with what it saves and the workers it takes, and accepted with it.
TEST(MemoryEstimateTest, ASequenceTooLongForOneRankIsToldToSetParallelCp) {
  const LongSequenceJobs jobs;
  const std::string& text = jobs.text;
  const v1::JobSpec& one = jobs.one;
  const v1::JobSpec& two = jobs.two;
  const absl::StatusOr<v1::Plan>& plan = jobs.plan;
  const absl::StatusOr<v1::Plan>& cp_plan = jobs.cp_plan;
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_TRUE(cp_plan.ok()) << cp_plan.status();
  const double need_one = EstimateWorkerMemory(one, *plan, 0).total();
  const double need_two = EstimateWorkerMemory(two, *cp_plan, 0).total();
  ASSERT_LT(need_two, need_one);
  const int64_t memory = static_cast<int64_t>((need_one + need_two) / 2);

  auto refused = MakePlan(one, Workers(1, memory), 1);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  const std::string message(refused.status().message());
  EXPECT_NE(message.find("set parallel.cp: 2 to split each sequence over 2 context-parallel ranks, on 2x the "
                         "workers (pp*tp*cp*dp = 2; up to " +
                         FormatBytes(need_one - EstimateWorkerMemory(two, *plan, 0).total()) + " less per worker)"),
            std::string::npos)
      << message;
  EXPECT_EQ(message.find("zero_stage"), std::string::npos) << "dp 1, cp 1: nothing to shard; " << message;

  auto accepted = MakePlan(two, Workers(2, memory), 1);
  ASSERT_TRUE(accepted.ok()) << accepted.status();
  EXPECT_EQ(accepted->ranks_size(), 2);

  // Short by more than cp 2 saves: the advice goes to cp 4 (4x the workers).
  const v1::JobSpec four = Job((text + "cp: 4 }").c_str());
  auto four_plan = MakePlan(four, Workers(4, 0), 1);
  ASSERT_TRUE(four_plan.ok()) << four_plan.status();
  const double need_four = EstimateWorkerMemory(four, *four_plan, 0).total();
  const int64_t less = static_cast<int64_t>((need_two + need_four) / 2);
  auto further = MakePlan(one, Workers(1, less), 1);
  ASSERT_FALSE(further.ok());
  EXPECT_NE(further.status().message().find("set parallel.cp: 4 to split each sequence over 4 context-parallel "
                                            "ranks, on 4x the workers (pp*tp*cp*dp = 4;"),
            std::string::npos)
      << further.status();
  EXPECT_TRUE(MakePlan(four, Workers(4, less), 1).ok());

  // A sequence that does not split into 2*cp chunks gets no cp advice.
  const v1::JobSpec odd = Job(R"pb(name: "c" model { layers: 2 d_model: 64 heads: 4 vocab: 64 seq_len: 2047 }
                                   schedule { kind: "gpipe" microbatches: 2 } train { steps: 1 micro_batch_size: 1 })pb");
  auto odd_plan = MakePlan(odd, Workers(1, 0), 1);
  ASSERT_TRUE(odd_plan.ok()) << odd_plan.status();
  auto no_cp = MakePlan(odd, Workers(1, static_cast<int64_t>(EstimateWorkerMemory(odd, *odd_plan, 0).total() / 2)), 1);
  ASSERT_FALSE(no_cp.ok());
  EXPECT_EQ(no_cp.status().message().find("parallel.cp"), std::string::npos) << no_cp.status();
}

// Mixture of Experts: `moe` is the model.moe block, "" for the dense model.
// GPT-2 of 4 blocks, d 64 (F 256), pp 2 x tp 2 x dp 2, 1f1b over 4
// microbatches of 2 x 16 tokens.
v1::JobSpec MoeGpt2(const std::string& moe, const std::string& parallel = "") {
  return Job((R"pb(name: "m" model { layers: 4 d_model: 64 heads: 4 vocab: 32 seq_len: 16 )pb" + moe +
              R"pb( } parallel { pp: 2 tp: 2 dp: 2 )pb" + parallel +
              R"pb( } schedule { kind: "1f1b" microbatches: 4 } train { steps: 1 micro_batch_size: 2 })pb")
                 .c_str());
}

// The MoE blocks (i + 1) % every == 0 of pipeline stage `chunk` of `plan`.
int MoeBlocksOfStage(const v1::Plan& plan, int chunk, int every) {
  int blocks = 0;
  const v1::StagePartition& p = plan.stages(chunk);
  for (int i = p.first_layer(); i < p.first_layer() + p.num_layers(); ++i) blocks += (i + 1) % every == 0;
  return blocks;
}

// An MoE block holds a router (E x C, replicated over tp) and E experts'
// c_fc and c_proj (split over tp, no biases) instead of the dense MLP's
// weights and biases: the estimate exceeds the dense one's by exactly that,
// in the parameters (fp32), and three times that in the gradients and AdamW
// moments; the activations trade the dense MLP's for the router's and the
// experts' rows.
TEST(MemoryEstimateTest, MoeBlocksHoldEveryExpertInsteadOfTheDenseMlp) {
  const v1::JobSpec dense = MoeGpt2("");
  const v1::JobSpec moe = MoeGpt2("moe { experts: 4 top_k: 2 every_n_layers: 2 }");
  auto plan = MakePlan(dense, Workers(8, 0), 1);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const double c = 64, f = 256, tp = 2, e = 4, k = 2, n = 2 * 16;
  const double dense_mlp = 2 * c * f / tp + f / tp + c;  // c_fc, c_proj; c_fc's split bias, c_proj's whole one
  const double experts = e * c + e * 2 * c * f / tp;      // router + E x (c_fc, c_proj)
  // Per microbatch: the router's logits, probabilities and two logit
  // gradients [n, E], expert/gate/slot/gate gradient [n, K], and n * K rows
  // of input, output and their gradients (4 C) and the MLP's h, g, dh, dg
  // (4 F'), instead of the dense MLP's fc, GELU and gradient (3 F' per token).
  const double rows = n * k;
  const double moe_activations = 4 * (4 * n * e + 4 * n * k + rows * (4 * c + 4 * f / tp) - 3 * n * f / tp);
  int total_moe_blocks = 0;
  for (int stage = 0; stage < 2; ++stage) {
    SCOPED_TRACE(stage);
    const int blocks = MoeBlocksOfStage(*plan, stage, 2);
    total_moe_blocks += blocks;
    const WorkerMemory a = EstimateWorkerMemory(dense, *plan, stage), b = EstimateWorkerMemory(moe, *plan, stage);
    EXPECT_DOUBLE_EQ(b.parameter_bytes - a.parameter_bytes, 4 * blocks * (experts - dense_mlp));
    EXPECT_DOUBLE_EQ(b.optimizer_bytes - a.optimizer_bytes, 3 * 4 * blocks * (experts - dense_mlp));
    EXPECT_DOUBLE_EQ(b.activation_bytes - a.activation_bytes, a.peak_microbatches * blocks * moe_activations);
    EXPECT_DOUBLE_EQ(b.comm_bytes - a.comm_bytes, b.parameter_bytes - a.parameter_bytes)
        << "the data-parallel group's flat gradient buffer holds the experts' gradients too";
    EXPECT_DOUBLE_EQ(b.scratch_bytes, a.scratch_bytes);
  }
  EXPECT_EQ(total_moe_blocks, 2) << "blocks 1 and 3";

  // ZeRO 1 shards the experts' moments with the rest of the chunk.
  const v1::JobSpec sharded = MoeGpt2("moe { experts: 4 top_k: 2 every_n_layers: 2 }", "zero_stage: 1");
  for (int stage = 0; stage < 2; ++stage) {
    const WorkerMemory b = EstimateWorkerMemory(moe, *plan, stage);
    const int64_t params = static_cast<int64_t>(b.parameter_bytes / 4);
    EXPECT_DOUBLE_EQ(EstimateWorkerMemory(sharded, *plan, stage).optimizer_bytes, 4.0 * params + 8 * Shard(params, 2))
        << stage;
  }
}

// Expert parallelism: with parallel.ep = 2 each rank holds half the experts
// of every MoE block (their weights, gradients and AdamW moments) and the
// whole router, so a worker's parameters fall by half the experts'
// matrices; the MoE blocks' C-wide expert buffers are held twice (this
// rank's layout and the all-to-all's).
TEST(MemoryEstimateTest, ExpertParallelismHoldsEachRanksShareOfTheExperts) {
  const v1::JobSpec dense = MoeGpt2("");
  const v1::JobSpec whole = MoeGpt2("moe { experts: 4 top_k: 2 every_n_layers: 2 }");
  const v1::JobSpec split = MoeGpt2("moe { experts: 4 top_k: 2 every_n_layers: 2 }", "ep: 2");
  auto plan = MakePlan(split, Workers(8, 0), 1);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->ep(), 2);
  const double c = 64, f = 256, tp = 2, e = 4, n = 2 * 16, rows = n * 2;
  const double expert_matrices = e * 2 * c * f / tp;  // E x (c_fc, c_proj) on one TP rank
  for (int stage = 0; stage < 2; ++stage) {
    SCOPED_TRACE(stage);
    const int blocks = MoeBlocksOfStage(*plan, stage, 2);
    ASSERT_EQ(blocks, 1);
    const WorkerMemory a = EstimateWorkerMemory(dense, *plan, stage), b = EstimateWorkerMemory(whole, *plan, stage),
                       x = EstimateWorkerMemory(split, *plan, stage);
    EXPECT_DOUBLE_EQ(b.parameter_bytes - x.parameter_bytes, 4 * blocks * expert_matrices / 2)
        << "half the experts' weights";
    EXPECT_DOUBLE_EQ(b.optimizer_bytes - x.optimizer_bytes, 3 * 4 * blocks * expert_matrices / 2)
        << "and their gradients and moments";
    // The experts' share of the worker's parameters (router included) is
    // more than halved: the router stays whole.
    const double whole_moe = b.parameter_bytes - a.parameter_bytes, split_moe = x.parameter_bytes - a.parameter_bytes;
    EXPECT_DOUBLE_EQ(split_moe, 4 * blocks * (e * c + expert_matrices / 2 - (2 * c * f / tp + f / tp + c)));
    EXPECT_LT(x.parameter_bytes + x.optimizer_bytes, b.parameter_bytes + b.optimizer_bytes);
    EXPECT_GT(whole_moe, 2 * split_moe);
    EXPECT_DOUBLE_EQ(x.activation_bytes - b.activation_bytes, b.peak_microbatches * blocks * 4 * rows * 4 * c)
        << "the exchanged input, output and their gradients";
  }
  // A job whose experts do not fit whole is told to split them, and fits split.
  const v1::JobSpec big = MoeGpt2("moe { experts: 64 top_k: 2 }");
  const v1::JobSpec big_split = MoeGpt2("moe { experts: 64 top_k: 2 }", "ep: 2");
  double need_whole = 0, need_split = 0;
  for (int stage = 0; stage < 2; ++stage) {
    need_whole = std::max(need_whole, EstimateWorkerMemory(big, *plan, stage).total());
    need_split = std::max(need_split, EstimateWorkerMemory(big_split, *plan, stage).total());
  }
  ASSERT_LT(need_split, need_whole);
  const int64_t memory = static_cast<int64_t>((need_whole + need_split) / 2);
  auto refused = MakePlan(big, Workers(8, memory), 1);
  ASSERT_FALSE(refused.ok());
  const std::string message(refused.status().message());
  EXPECT_NE(message.find("set parallel.ep: 2 to split each MoE block's 64 experts over 2 data-parallel ranks (up "
                         "to "),
            std::string::npos)
      << message;
  EXPECT_TRUE(MakePlan(big_split, Workers(8, memory), 1).ok());
  // Split, ZeRO 1 (not with ep yet) and more ep (dp is 2) are not offered.
  auto still = MakePlan(big_split, Workers(8, static_cast<int64_t>(need_split / 2)), 1);
  ASSERT_FALSE(still.ok());
  const std::string split_message(still.status().message());
  EXPECT_EQ(split_message.find("parallel.zero_stage"), std::string::npos) << split_message;
  EXPECT_EQ(split_message.find("parallel.ep"), std::string::npos) << split_message;
  EXPECT_NE(split_message.find("lower model.moe.experts (every rank holds experts/ep = 32 of each MoE block)"),
            std::string::npos)
      << split_message;
}

// Llama's experts are SwiGLU MLPs (w1, w3 [F, C], w2 [C, F]); with a capacity
// factor each expert holds ceil(factor * N * K / E) rows, at most N.
TEST(MemoryEstimateTest, LlamaMoeExpertsAndTheirCapacity) {
  const v1::JobSpec dense = SmallLlama("kv_heads: 2");  // 2 blocks, C 16, F 24, N 8, one worker
  const v1::JobSpec moe = SmallLlama("kv_heads: 2 moe { experts: 3 top_k: 2 capacity_factor: 1.25 }");
  auto plan = MakePlan(dense, Workers(1, 0), 1);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const double c = 16, f = 24, e = 3, k = 2, n = 8;
  const double per_block = e * c + e * 3 * c * f - 3 * c * f;
  const WorkerMemory a = EstimateWorkerMemory(dense, *plan, 0), b = EstimateWorkerMemory(moe, *plan, 0);
  EXPECT_DOUBLE_EQ(b.parameter_bytes - a.parameter_bytes, 4 * 2 * per_block) << "both blocks";
  EXPECT_DOUBLE_EQ(b.optimizer_bytes - a.optimizer_bytes, 3 * 4 * 2 * per_block);
  const double rows = e * std::ceil(1.25 * n * k / e);  // 3 x ceil(6.67) = 21
  ASSERT_EQ(rows, 21);
  EXPECT_DOUBLE_EQ(b.activation_bytes - a.activation_bytes,
                   2 * 4 * (4 * n * e + 4 * n * k + rows * (4 * c + 6 * f) - 6 * n * f))
      << "Llama's h, up, g and their gradients per row, as its dense MLP's per token";
}

// Workers with room for the dense model but not for its experts: the MoE job
// is refused naming the stage, the worker and the numbers, with the usual
// advice and the experts to lower; the dense job is planned.
TEST(MemoryEstimateTest, AnMoeJobThatDoesNotFitIsRefusedNamingTheExperts) {
  const v1::JobSpec dense = MoeGpt2("");
  const v1::JobSpec moe = MoeGpt2("moe { experts: 64 top_k: 2 }");
  auto dense_plan = MakePlan(dense, Workers(8, 0), 1);
  auto moe_plan = MakePlan(moe, Workers(8, 0), 1);
  ASSERT_TRUE(dense_plan.ok()) << dense_plan.status();
  ASSERT_TRUE(moe_plan.ok()) << moe_plan.status();
  double need_dense = 0, need_moe = 0;
  for (int stage = 0; stage < 2; ++stage) {
    need_dense = std::max(need_dense, EstimateWorkerMemory(dense, *dense_plan, stage).total());
    need_moe = std::max(need_moe, EstimateWorkerMemory(moe, *moe_plan, stage).total());
  }
  ASSERT_LT(need_dense, need_moe);
  const int64_t memory = static_cast<int64_t>((need_dense + need_moe) / 2);
  auto refused = MakePlan(moe, Workers(8, memory), 1);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  const std::string message(refused.status().message());
  EXPECT_NE(message.find("job 'm': pipeline stage "), std::string::npos) << message;
  EXPECT_NE(message.find("parameters "), std::string::npos) << message;
  EXPECT_NE(message.find("set parallel.zero_stage: 1"), std::string::npos) << message;
  EXPECT_NE(message.find("lower model.moe.experts (every rank holds all experts of its blocks), "), std::string::npos)
      << message;
  EXPECT_NE(message.find("lower train.micro_batch_size"), std::string::npos) << message;
  EXPECT_NE(message.find("raise parallel.pp or parallel.tp"), std::string::npos) << message;
  EXPECT_TRUE(MakePlan(dense, Workers(8, memory), 1).ok());
  auto dense_refused = MakePlan(dense, Workers(8, static_cast<int64_t>(need_dense / 2)), 1);
  ASSERT_FALSE(dense_refused.ok());
  EXPECT_EQ(dense_refused.status().message().find("model.moe"), std::string::npos) << dense_refused.status();
}

}  // namespace
}  // namespace baton
