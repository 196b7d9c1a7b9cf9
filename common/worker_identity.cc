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

absl::Status ValidateHostName(const std::string& host) {
  if (host.empty() || host.size() > 253) return absl::InvalidArgumentError("host must be 1..253 characters");
  for (char c : host) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '_' && c != '.') {
      return absl::InvalidArgumentError(
          absl::StrCat("host '", host, "' may only hold letters, digits, '-', '_' and '.' (a DNS name)"));
    }
  }
  return absl::OkStatus();
}

bool IsValidGpuUuid(const std::string& uuid) {
  if (uuid.size() > 64) return false;
  for (char c : uuid) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '-') return false;
  }
  return true;
}

bool IsValidDevice(const std::string& device) {
  if (device == "cpu") return true;
  // "sim:N" is the test-only simulated device (kernels/sim): valid as a name;
  // only a worker built with it can configure a job on it.
  for (const absl::string_view prefix : {absl::string_view("cuda:"), absl::string_view("sim:")}) {
    int ordinal;
    if (absl::StartsWith(device, prefix) && device.size() > prefix.size() &&
        absl::ascii_isdigit(device[prefix.size()]) && absl::SimpleAtoi(device.substr(prefix.size()), &ordinal) &&
        ordinal >= 0) {
      return true;
    }
  }
  return false;
}

}  // namespace baton
