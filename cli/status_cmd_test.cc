#include "cli/status_cmd.h"

#include "common/json.h"
#include "gtest/gtest.h"

namespace baton::cli {
namespace {

// Scripts read each worker's device facts as it registered them, fused
// attention included (it decides whether the memory estimate counts P).
TEST(StatusJsonTest, WorkersShowTheirDeviceFactsFusedAttentionIncluded) {
  v1::GetStatusResponse status;
  v1::WorkerInfo* gpu = status.add_workers();
  gpu->set_name("w0");
  gpu->set_device("cuda:0");
  gpu->set_device_uuid("GPU-a");
  gpu->set_memory_bytes(int64_t{141} << 30);
  gpu->set_fused_attention_bf16(true);
  v1::WorkerInfo* cpu = status.add_workers();
  cpu->set_name("w1");
  cpu->set_device("cpu");

  absl::StatusOr<JsonValue> json = JsonValue::Parse(StatusJson("127.0.0.1:7000", status));
  ASSERT_TRUE(json.ok()) << json.status();
  const JsonValue* workers = json->Find("workers");
  ASSERT_NE(workers, nullptr);
  ASSERT_EQ(workers->items().size(), 2u);
  const JsonValue& w0 = workers->items()[0];
  ASSERT_NE(w0.Find("fused_attention_bf16"), nullptr);
  EXPECT_TRUE(w0.Find("fused_attention_bf16")->bool_value());
  EXPECT_EQ(w0.Find("device_uuid")->str(), "GPU-a");
  EXPECT_EQ(w0.Find("memory_bytes")->integer(), int64_t{141} << 30);
  const JsonValue& w1 = workers->items()[1];
  ASSERT_NE(w1.Find("fused_attention_bf16"), nullptr);
  EXPECT_FALSE(w1.Find("fused_attention_bf16")->bool_value());
  EXPECT_EQ(w1.Find("device")->str(), "cpu");
}

// The held-out loss is there once an evaluation ran, null before.
TEST(StatusJsonTest, TheLastEvaluationIsShownOnceThereIsOne) {
  v1::GetStatusResponse status;
  absl::StatusOr<JsonValue> none = JsonValue::Parse(StatusJson("t", status));
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_EQ(none->Find("eval_step")->integer(), 0);
  EXPECT_EQ(none->Find("eval_loss")->kind(), JsonValue::Kind::kNull);
  status.set_eval_step(40);
  status.set_eval_loss(2.5);
  status.set_eval_perplexity(12.182);
  absl::StatusOr<JsonValue> json = JsonValue::Parse(StatusJson("t", status));
  ASSERT_TRUE(json.ok()) << json.status();
  EXPECT_EQ(json->Find("eval_step")->integer(), 40);
  EXPECT_DOUBLE_EQ(json->Find("eval_loss")->number(), 2.5);
  EXPECT_DOUBLE_EQ(json->Find("eval_perplexity")->number(), 12.182);
}

// An MoE job's stages show the share of choices dropped at capacity, in
// the JSON and as a MOE DROP column; a dense job's table and JSON have none
// (the column is not there at all, the JSON field is null).
TEST(StatusStagesTest, AnMoeJobShowsItsDroppedShareAndADenseJobDoesNot) {
  v1::GetStatusResponse dense;
  for (int pp = 0; pp < 2; ++pp) {
    v1::StageStatus* st = dense.add_stages();
    st->set_pp_rank(pp);
    st->set_step(3);
    st->set_activation_bytes(3 << 20);
    st->add_workers(pp == 0 ? "w0" : "w1");
  }
  const std::string dense_table = StagesTable(dense);
  EXPECT_EQ(dense_table.find("MOE"), std::string::npos) << dense_table;
  EXPECT_NE(dense_table.find("ACT MiB  WORKERS\n"), std::string::npos) << dense_table;
  EXPECT_NE(dense_table.find("3.0      w1\n"), std::string::npos) << dense_table;
  absl::StatusOr<JsonValue> dense_json = JsonValue::Parse(StatusJson("t", dense));
  ASSERT_TRUE(dense_json.ok()) << dense_json.status();
  EXPECT_EQ(dense_json->Find("stages")->items()[0].Find("moe_dropped_ratio")->kind(), JsonValue::Kind::kNull);

  v1::GetStatusResponse moe = dense;
  moe.mutable_stages(0)->set_moe_dropped_ratio(0.125);
  moe.mutable_stages(1)->set_moe_dropped_ratio(0.0);
  const std::string table = StagesTable(moe);
  EXPECT_NE(table.find("ACT MiB  MOE DROP WORKERS\n"), std::string::npos) << table;
  EXPECT_NE(table.find("3.0      12.5%    w0\n"), std::string::npos) << table;
  EXPECT_NE(table.find("3.0      0.0%     w1\n"), std::string::npos) << table;
  absl::StatusOr<JsonValue> json = JsonValue::Parse(StatusJson("t", moe));
  ASSERT_TRUE(json.ok()) << json.status();
  EXPECT_DOUBLE_EQ(json->Find("stages")->items()[0].Find("moe_dropped_ratio")->number(), 0.125);
  EXPECT_DOUBLE_EQ(json->Find("stages")->items()[1].Find("moe_dropped_ratio")->number(), 0.0);
}

}  // namespace
}  // namespace baton::cli
