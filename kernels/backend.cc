#include "kernels/backend.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/status_macros.h"

namespace baton::kernels {

const Backend& CpuBackend();  // cpu_backend.cc

namespace {

[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "baton::kernels: %s\n", what.c_str());
  std::abort();
}

struct Registry {
  absl::Mutex mu;
  std::map<DeviceType, const Backend*> backends ABSL_GUARDED_BY(mu);
};

Registry& GetRegistry() {
  static Registry* registry = new Registry();
  return *registry;
}

struct MemoryBook {
  absl::Mutex mu;
  std::map<std::pair<DeviceType, int>, MemoryStats> stats ABSL_GUARDED_BY(mu);
};

MemoryBook& Book() {
  static MemoryBook* book = new MemoryBook();
  return *book;
}

std::atomic<int64_t> host_syncs{0};

// Address ranges handed out by PinnedHostZeros: start -> end.
struct PinnedBook {
  absl::Mutex mu;
  std::map<uintptr_t, uintptr_t> ranges ABSL_GUARDED_BY(mu);
};

PinnedBook& Pinned() {
  static PinnedBook* book = new PinnedBook();
  return *book;
}

absl::StatusOr<const Backend*> BackendOf(Device device) {
  const Backend* backend = FindBackend(device.type);
  if (backend == nullptr) {
    return absl::UnavailableError(absl::StrCat("device ", DeviceToString(device),
                                               ": no kernel backend for it is linked into this "
                                               "binary"));
  }
  return backend;
}

}  // namespace

void RegisterBackend(const Backend* backend) {
  Registry& r = GetRegistry();
  absl::MutexLock lock(&r.mu);
  if (backend->type == DeviceType::kCpu || r.backends.count(backend->type) != 0) {
    Die(absl::StrCat("RegisterBackend: a backend for '", backend->name, "' is already registered"));
  }
  r.backends[backend->type] = backend;
}

const Backend* FindBackend(DeviceType type) {
  if (type == DeviceType::kCpu) return &CpuBackend();
  Registry& r = GetRegistry();
  absl::MutexLock lock(&r.mu);
  auto it = r.backends.find(type);
  return it == r.backends.end() ? nullptr : it->second;
}

absl::Status ProbeDevice(Device device) {
  absl::StatusOr<const Backend*> backend = BackendOf(device);
  if (!backend.ok()) return backend.status();
  return (*backend)->probe(device.index);
}

absl::Status ProbeFusedAttention(Device device) {
  absl::StatusOr<const Backend*> backend = BackendOf(device);
  if (!backend.ok()) return backend.status();
  if ((*backend)->fused_attention == nullptr) {
    return absl::UnimplementedError(absl::StrCat("the ", (*backend)->name,
                                                 " backend has no fused attention: it keeps P"));
  }
  return (*backend)->fused_attention(device.index);
}

// --- Stream / Event ---

absl::StatusOr<std::unique_ptr<Stream>> Stream::Create(Device device) {
  absl::StatusOr<const Backend*> backend = BackendOf(device);
  if (!backend.ok()) return backend.status();
  absl::StatusOr<void*> native = (*backend)->create_stream(device.index);
  if (!native.ok()) return native.status();
  return std::unique_ptr<Stream>(new Stream(*backend, device, *native));
}

Stream::~Stream() { backend_->destroy_stream(device_.index, native_); }

absl::Status Stream::Synchronize() {
  host_syncs.fetch_add(1, std::memory_order_relaxed);
  return backend_->synchronize_stream(native_);
}

namespace {
void RunHostFunc(void* arg) {
  auto* fn = static_cast<std::function<void()>*>(arg);
  (*fn)();
  delete fn;
}
}  // namespace

absl::Status Stream::LaunchHostFunc(std::function<void()> fn) {
  auto* arg = new std::function<void()>(std::move(fn));
  absl::Status status = backend_->launch_host_func(native_, RunHostFunc, arg);
  if (!status.ok()) delete arg;  // not enqueued: it never runs
  return status;
}

absl::StatusOr<std::unique_ptr<Event>> Event::Create(Device device) {
  absl::StatusOr<const Backend*> backend = BackendOf(device);
  if (!backend.ok()) return backend.status();
  absl::StatusOr<void*> native = (*backend)->create_event(device.index);
  if (!native.ok()) return native.status();
  return std::unique_ptr<Event>(new Event(*backend, device, *native));
}

Event::~Event() { backend_->destroy_event(device_.index, native_); }

absl::Status Event::Record(Stream& stream) {
  if (stream.device() != device_) {
    return absl::InvalidArgumentError("Event::Record: the stream is on another device");
  }
  return backend_->record_event(native_, stream.native());
}

absl::Status Event::StreamWait(Stream& stream) {
  if (stream.device() != device_) {
    return absl::InvalidArgumentError("Event::StreamWait: the stream is on another device");
  }
  return backend_->stream_wait_event(stream.native(), native_);
}

absl::Status Event::Synchronize() {
  host_syncs.fetch_add(1, std::memory_order_relaxed);
  return backend_->synchronize_event(native_);
}

absl::StatusOr<double> Event::SecondsSince(const Event& start) const {
  if (start.device_ != device_) {
    return absl::InvalidArgumentError("Event::SecondsSince: events on different devices");
  }
  return backend_->event_seconds(start.native_, native_);
}

int64_t HostSyncCount() { return host_syncs.load(std::memory_order_relaxed); }

void NoteHostSync() { host_syncs.fetch_add(1, std::memory_order_relaxed); }

// --- ExecContext ---

const ExecContext& ExecContext::Host() {
  static const ExecContext* host = [] {
    auto* ctx = new ExecContext();
    ctx->device = Device::Cpu();
    ctx->backend = &CpuBackend();
    return ctx;
  }();
  return *host;
}

ExecContext ExecContext::On(Stream* stream, Arena* scratch, Precision precision) {
  ExecContext ctx;
  ctx.device = stream->device();
  ctx.backend = stream->backend_;
  ctx.stream = stream;
  ctx.scratch = scratch;
  ctx.precision = precision;
  return ctx;
}

// --- memory ---

namespace {
constexpr absl::string_view kOutOfMemoryPayload = "type.baton.dev/out_of_memory";
}  // namespace

absl::Status OutOfMemoryError(absl::string_view message) {
  absl::Status s = absl::ResourceExhaustedError(message);
  s.SetPayload(kOutOfMemoryPayload, absl::Cord());
  return s;
}

bool IsOutOfMemory(const absl::Status& status) {
  return absl::IsResourceExhausted(status) && status.GetPayload(kOutOfMemoryPayload).has_value();
}

absl::StatusOr<void*> AllocateDevice(Device device, size_t bytes) {
  absl::StatusOr<const Backend*> backend = BackendOf(device);
  if (!backend.ok()) return backend.status();
  absl::StatusOr<void*> p = (*backend)->allocate(device.index, bytes == 0 ? 64 : bytes);
  if (!p.ok()) return WithContext(p.status(), absl::StrCat("allocating ", bytes, " bytes on ", DeviceToString(device)));
  MemoryBook& book = Book();
  absl::MutexLock lock(&book.mu);
  MemoryStats& s = book.stats[{device.type, device.index}];
  s.reserved_bytes += static_cast<int64_t>(bytes);
  s.peak_reserved_bytes = std::max(s.peak_reserved_bytes, s.reserved_bytes);
  ++s.system_allocations;
  return *p;
}

void FreeDevice(Device device, void* p, size_t bytes) {
  if (p == nullptr) return;
  const Backend* backend = FindBackend(device.type);
  if (backend == nullptr) Die("FreeDevice: no backend for the device");
  backend->free(device.index, p);
  MemoryBook& book = Book();
  absl::MutexLock lock(&book.mu);
  book.stats[{device.type, device.index}].reserved_bytes -= static_cast<int64_t>(bytes);
}

void CountInUse(Device device, int64_t delta) {
  if (delta == 0) return;
  MemoryBook& book = Book();
  absl::MutexLock lock(&book.mu);
  book.stats[{device.type, device.index}].in_use_bytes += delta;
}

MemoryStats GetMemoryStats(Device device) {
  MemoryBook& book = Book();
  absl::MutexLock lock(&book.mu);
  auto it = book.stats.find({device.type, device.index});
  return it == book.stats.end() ? MemoryStats() : it->second;
}

namespace {

// Tensor::TryZeros, its failed allocation marked as out of memory.
absl::StatusOr<Tensor> HostZeros(Shape shape, DType dtype) {
  absl::StatusOr<Tensor> t = Tensor::TryZeros(std::move(shape), dtype);
  if (t.status().code() == absl::StatusCode::kResourceExhausted) return OutOfMemoryError(t.status().message());
  return t;
}

}  // namespace

absl::StatusOr<Tensor> PinnedHostZeros(Device device, Shape shape, DType dtype) {
  if (device.is_cpu()) return HostZeros(std::move(shape), dtype);
  if (absl::StatusOr<size_t> checked = AlignedBytes(shape, dtype); !checked.ok()) return checked.status();
  absl::StatusOr<const Backend*> backend = BackendOf(device);
  if (!backend.ok()) return backend.status();
  const size_t bytes = std::max<size_t>(1, static_cast<size_t>(NumElements(shape)) * DTypeSize(dtype));
  absl::StatusOr<void*> p = (*backend)->allocate_host(device.index, bytes);
  if (!p.ok()) {
    return WithContext(p.status(),
                       absl::StrCat("allocating ", bytes, " bytes of pinned host memory for ", DeviceToString(device)));
  }
  std::memset(*p, 0, bytes);
  const uintptr_t start = reinterpret_cast<uintptr_t>(*p);
  {
    PinnedBook& book = Pinned();
    absl::MutexLock lock(&book.mu);
    book.ranges[start] = start + bytes;
  }
  const Backend* be = *backend;
  const int index = device.index;
  std::shared_ptr<void> storage(*p, [be, index, start](void* q) {
    {
      PinnedBook& book = Pinned();
      absl::MutexLock lock(&book.mu);
      book.ranges.erase(start);
    }
    be->free_host(index, q);
  });
  return Tensor::Adopt(std::move(storage), std::move(shape), dtype, Device::Cpu());
}

bool IsPinnedHost(const Tensor& t) {
  if (!t.device().is_cpu() || t.address() == nullptr) return false;
  const uintptr_t begin = reinterpret_cast<uintptr_t>(t.address());
  PinnedBook& book = Pinned();
  absl::MutexLock lock(&book.mu);
  auto it = book.ranges.upper_bound(begin);  // the first range starting after t
  if (it == book.ranges.begin()) return false;
  --it;
  return begin + t.bytes() <= it->second;
}

absl::StatusOr<Tensor> ZerosOn(Device device, Shape shape, DType dtype) {
  if (device.is_cpu()) return HostZeros(std::move(shape), dtype);
  if (absl::StatusOr<size_t> checked = AlignedBytes(shape, dtype); !checked.ok()) return checked.status();
  const size_t bytes = static_cast<size_t>(NumElements(shape)) * DTypeSize(dtype);
  absl::StatusOr<void*> p = AllocateDevice(device, bytes);
  if (!p.ok()) return p.status();
  CountInUse(device, static_cast<int64_t>(bytes));
  std::shared_ptr<void> storage(*p, [device, bytes](void* q) {
    CountInUse(device, -static_cast<int64_t>(bytes));
    FreeDevice(device, q, bytes);
  });
  Tensor t = Tensor::Adopt(std::move(storage), std::move(shape), dtype, device);
  // Zero it on a stream of its own and wait, so the tensor is ready for any
  // stream (an initialisation, before steps run).
  absl::StatusOr<std::unique_ptr<Stream>> stream = Stream::Create(device);
  if (!stream.ok()) return stream.status();
  const ExecContext ctx = ExecContext::On(stream->get());
  ctx.backend->fill_zero(ctx, t);
  absl::Status s = (*stream)->Synchronize();
  if (!s.ok()) return s;
  return t;
}

}  // namespace baton::kernels
