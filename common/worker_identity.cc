#include "common/worker_identity.h"

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace baton {

namespace {

// 1..`max` of [A-Za-z0-9._-]; INVALID_ARGUMENT naming `what` otherwise.
absl::Status ValidatePlainName(const char* what, const std::string& text, size_t max, const char* hint) {
  if (text.empty() || text.size() > max) {
    return absl::InvalidArgumentError(absl::StrCat(what, " must be 1..", max, " characters"));
  }
  for (char c : text) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '_' && c != '.') {
      return absl::InvalidArgumentError(
          absl::StrCat(what, " '", text, "' may only hold letters, digits, '-', '_' and '.'", hint));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateWorkerName(const std::string& name) { return ValidatePlainName("name", name, 128, ""); }

absl::Status ValidateHostName(const std::string& host) {
  return ValidatePlainName("host", host, 253, " (a DNS name)");
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
