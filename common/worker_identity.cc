#include "common/worker_identity.h"

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace baton {

absl::Status ValidateWorkerName(const std::string& name) {
  if (name.empty() || name.size() > 128) return absl::InvalidArgumentError("name must be 1..128 characters");
  for (char c : name) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '_' && c != '.') {
      return absl::InvalidArgumentError(
          absl::StrCat("name '", name, "' may only hold letters, digits, '-', '_' and '.'"));
    }
  }
  return absl::OkStatus();
}

bool IsValidDevice(const std::string& device) {
  if (device == "cpu") return true;
  int ordinal;
  return absl::StartsWith(device, "cuda:") && absl::SimpleAtoi(device.substr(5), &ordinal) && ordinal >= 0 &&
         device.size() > 5 && absl::ascii_isdigit(device[5]);
}

}  // namespace baton
