// Fuzzes the schedule readers (PyTorch compute-only CSV and JSON programs)
// and, for what parses, the validator: any bytes must give a schedule or a
// clear error, never a crash or unbounded memory.
#include <cstddef>
#include <cstdint>
#include <string>

#include "coordinator/schedule/ir.h"
#include "coordinator/schedule/pytorch_csv.h"
#include "coordinator/schedule/validator.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<baton::schedule::Schedule> s = !text.empty() && text[0] == '['
                                                    ? baton::schedule::FromProgramsJson(text)
                                                    : baton::schedule::FromPytorchCsv(text);
  if (s.ok()) baton::schedule::Validate(*s).IgnoreError();
  return 0;
}
