// Frames over an in-process group: any length both ways and in order, a
// frame over the receiver's bound or late aborts the communicator with a
// clear error, and an unbounded wait ends when the communicator is aborted.
#include "worker/comm/frame.h"

#include <string>
#include <thread>

#include "gtest/gtest.h"
#include "worker/comm/inproc_communicator.h"

namespace baton::comm {
namespace {

constexpr absl::Duration kWait = absl::Seconds(30);  // a bound, not a timing assertion

TEST(FrameTest, FramesOfAnyLengthArriveWholeAndInOrder) {
  auto group = InProcCommunicator::CreateGroup(2);
  const std::vector<std::string> frames = {"", "x", std::string(100000, 'q'), "last"};
  std::thread sender([&] {
    for (const std::string& f : frames) EXPECT_TRUE(SendFrame(*group[0], 1, 10, f, kWait, "test frame").ok());
  });
  for (const std::string& f : frames) {
    absl::StatusOr<std::string> got = RecvFrame(*group[1], 0, 10, 1 << 20, kWait, "test frame");
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(*got, f);
  }
  sender.join();
  // And back.
  std::thread back([&] { EXPECT_TRUE(SendFrame(*group[1], 0, 10, "reply", kWait, "reply").ok()); });
  absl::StatusOr<std::string> got = RecvFrame(*group[0], 1, 10, 16, kWait, "reply");
  back.join();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, "reply");
}

TEST(FrameTest, AFrameOverTheBoundIsRefusedAndAbortsTheCommunicator) {
  auto group = InProcCommunicator::CreateGroup(2);
  std::thread sender([&] { SendFrame(*group[0], 1, 4, std::string(11, 'a'), kWait, "report").IgnoreError(); });
  absl::StatusOr<std::string> got = RecvFrame(*group[1], 0, 4, 10, kWait, "report of pipeline rank 0");
  EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(got.status().message().find("report of pipeline rank 0: a frame of 11 bytes, over the bound of 10"),
            std::string::npos)
      << got.status();
  group[0]->Abort("test over");  // the sender's body has no receiver
  sender.join();
  // Aborted: later ops fail fast.
  EXPECT_FALSE(RecvFrame(*group[1], 0, 4, 10, kWait, "after").ok());
}

TEST(FrameTest, ALateFrameIsDeadlineExceededAndAbortsTheCommunicator) {
  auto group = InProcCommunicator::CreateGroup(2);
  absl::StatusOr<std::string> got = RecvFrame(*group[1], 0, 4, 10, absl::Milliseconds(50), "step from the leader");
  EXPECT_EQ(got.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(got.status().message().find("step from the leader: not complete after 50ms"), std::string::npos)
      << got.status();
  EXPECT_EQ(RecvFrame(*group[1], 0, 4, 10, kWait, "after").status().code(), absl::StatusCode::kAborted);
}

TEST(FrameTest, AnUnboundedWaitEndsWhenTheCommunicatorIsAborted) {
  auto group = InProcCommunicator::CreateGroup(2);
  std::thread aborter([&] {
    absl::SleepFor(absl::Milliseconds(1200));  // past one wait slice
    group[1]->Abort("job dropped");
  });
  absl::StatusOr<std::string> got =
      RecvFrame(*group[1], 0, 4, 10, absl::InfiniteDuration(), "next step from the leader");
  aborter.join();
  EXPECT_EQ(got.status().code(), absl::StatusCode::kAborted) << got.status();
  EXPECT_NE(got.status().message().find("next step from the leader"), std::string::npos) << got.status();
}

}  // namespace
}  // namespace baton::comm
