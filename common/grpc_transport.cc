#include "common/grpc_transport.h"

#include <grpc/grpc.h>

namespace baton {

void SetTransportArgs(grpc::ServerBuilder* builder) { builder->AddChannelArgument(GRPC_ARG_HTTP2_BDP_PROBE, 0); }

void SetTransportArgs(grpc::ChannelArguments* args) { args->SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0); }

}  // namespace baton
