// The communicator's view of a tensor (worker/comm/communicator.h): host
// memory, or CUDA memory with its ordinal. Memory of the simulated device
// (kernels/sim) is host memory that only its streams touch; a communicator
// reads it as host memory once the caller has synchronised the producing
// stream, which is what a staging communicator does for CUDA memory.
#ifndef BATON_WORKER_MODEL_COMM_BUFFER_H_
#define BATON_WORKER_MODEL_COMM_BUFFER_H_

#include "kernels/tensor.h"
#include "worker/comm/communicator.h"

namespace baton::model {

inline comm::Buffer CommBuffer(const kernels::Tensor& t) {
  comm::Buffer b;
  b.data = t.address();
  b.count = t.numel();
  switch (t.dtype()) {
    case kernels::DType::kInt32: b.dtype = comm::DType::kInt32; break;
    case kernels::DType::kInt64: b.dtype = comm::DType::kInt64; break;
    case kernels::DType::kFloat32: b.dtype = comm::DType::kFloat32; break;
    default:  // bf16 and float64 travel as bytes
      b.dtype = comm::DType::kUInt8;
      b.count = static_cast<int64_t>(t.bytes());
      break;
  }
  b.device = t.device().type == kernels::DeviceType::kCuda ? t.device().index : -1;
  return b;
}

}  // namespace baton::model

#endif  // BATON_WORKER_MODEL_COMM_BUFFER_H_
