// The HTTP/2 transport settings of the coordinator's gRPC server and of the
// worker's channel to it, in one place so both ends (and the benches that
// stand in for them) agree.
#ifndef BATON_COMMON_GRPC_TRANSPORT_H_
#define BATON_COMMON_GRPC_TRANSPORT_H_

#include <grpcpp/server_builder.h>
#include <grpcpp/support/channel_arguments.h>

namespace baton {

// No bandwidth-delay probing (GRPC_ARG_HTTP2_BDP_PROBE 0): a receiver that
// probes sends a PING after the data it reads and waits for its ack, a fifth
// of the coordinator's CPU per step at 1,024 workers (docs/BENCHMARKS.md).
// The price is the speed of big Session messages (snapshots, relayed
// copies, fetched states) on a long round trip: without the probe the flow-
// control windows do not grow, and a hop carries about 0.8 MiB per round
// trip where the probe reaches about 4 MiB (bench/session_window_bench.cc,
// docs/protocol.md "Snapshots"). Raising the stream window by hand
// (GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 4 to 64 MiB) changed nothing there.
void SetTransportArgs(grpc::ServerBuilder* builder);
void SetTransportArgs(grpc::ChannelArguments* args);

}  // namespace baton

#endif  // BATON_COMMON_GRPC_TRANSPORT_H_
