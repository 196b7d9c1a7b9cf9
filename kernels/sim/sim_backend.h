// The simulated device (test-only): DeviceType::kSim, registered when
// //kernels/sim:sim_backend is linked (alwayslink).
//
// Memory is host memory tagged as device memory, so Tensor's host accessors
// (f32(), i32(), raw()) abort on it: any host access the model or executor
// forgot to route through kernels::Copy shows up as a crash naming the tensor.
// Each stream is a thread running its queue in order, asynchronously to the
// host. By default streams are lazy: an op runs only once something waits for
// it (Stream::Synchronize, Event::Synchronize, a StreamWait of another stream
// that is itself waited for), so a host read or another
// stream's op that skipped its wait deterministically sees stale data, and
// the test comparing against the CPU's bits fails. A host function
// (Stream::LaunchHostFunc) is the exception: it is released as soon as it is
// enqueued, with the stream's work before it, since it stands for
// communication a peer may be blocked on. Events are real: Record marks a point
// in a stream's queue, StreamWait makes another stream's later work wait for
// it, Synchronize blocks the host. Kernels are the CPU backend's, run on the
// stream thread over host views of the same memory, so results are the CPU's
// bits. Freeing memory is stream-ordered: it is released once every stream
// of the device has passed the work enqueued before the free (the host does
// not wait).
#ifndef BATON_KERNELS_SIM_SIM_BACKEND_H_
#define BATON_KERNELS_SIM_SIM_BACKEND_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace baton::kernels::sim {

// Lazy (default) or eager streams; applies to streams created afterwards.
void SetSimLazy(bool on);
// Sleep before every op on every simulated stream (default 0).
void SetSimOpDelay(absl::Duration delay);
// Ops run on simulated streams so far (for tests that want to see work move).
int64_t SimOpsRun();
// Caps what each simulated device may hold (its GetMemoryStats
// reserved_bytes) at `bytes`; an allocation past it fails with
// RESOURCE_EXHAUSTED as cudaMalloc does on a full GPU. 0 (the default): no
// limit. Checked per allocation against the device's current reserved bytes,
// so concurrent allocations on one device may together overshoot it slightly.
void SetSimDeviceMemoryLimitForTesting(int64_t bytes);
// Gives every live stream of sim:`device` the sticky error `status` (kept if
// it has one), as the CUDA backend keeps the first failure of an op enqueued
// on a stream (e.g. a scratch buffer that could not grow): the stream's
// Synchronize, event record and wait, and host function launch return it
// from then on. Streams created later start clean.
void SetSimStreamErrorForTesting(int device, absl::Status status);

}  // namespace baton::kernels::sim

#endif  // BATON_KERNELS_SIM_SIM_BACKEND_H_
